"""Models: loading a model and tokenizer the same way for training, evaluation and the reference cache
(`loading`), where a model name or path points (`source`), LoRA adapters (`lora`), a model's whole weights
(`weights`) and its Hugging Face export (`export`), and the built-in tiny model with its SFT warm start
(`tiny`, `sft`)."""
