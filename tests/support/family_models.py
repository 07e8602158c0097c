"""Tiny causal LMs of the families with a final-logit transform (Gemma-2 / 3 soft-caps, Granite's scaling) and an
MoE without one, built from configs at one layer and hidden size 32 over a vocabulary of 64 (no tokenizer, no
download)."""
import torch
import transformers


def tiny_lm(kind: str, **extra):
    """An fp32 model in eval mode of `kind` ("gemma2", "gemma3", "qwen3_moe", else Granite), `extra` config fields
    on top, seed 0, its lm_head scaled by 40 so that its logit transform bites."""
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "gemma2":
        config = transformers.Gemma2Config(**common, final_logit_softcapping=2.0, **extra)
        cls = transformers.Gemma2ForCausalLM
    elif kind == "gemma3":   # its text config; a sliding window shorter than the longest prompt + response
        config = transformers.Gemma3TextConfig(**common, final_logit_softcapping=2.0, sliding_window=4, **extra)
        cls = transformers.Gemma3ForCausalLM
    elif kind == "qwen3_moe":   # no logit transform; tied embeddings, 2 of 4 experts per token
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                             tie_word_embeddings=True, **extra)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.GraniteConfig(**common, logits_scaling=0.25, **extra)
        cls = transformers.GraniteForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():   # logits large enough for the transform to bite
        model.get_output_embeddings().weight.mul_(40.0)
    return model
