"""The built-in tiny model: a character-level tokenizer and a small Qwen2-architecture model, no downloads."""
from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, BOS_CHAT, EOS_CHAT = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS_CHAT, EOS_CHAT]
CHARACTERS = list(string.printable[:-2])  # digits, letters, punctuation, space, \t, \n (no \r, \x0b, \x0c)

# Qwen-style chat template, short so that prompts stay cheap on a CPU.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_symbol(char: str) -> str:
    """The symbol GPT-2/Qwen byte-level pre-tokenization uses for a one-byte character (' ' -> 'Ġ', '\\n' -> 'Ċ')."""
    byte = ord(char)
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if byte in printable:
        return char
    return chr(256 + sum(1 for b in range(byte) if b not in printable))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one id per printable ASCII character plus the three chat special tokens.

    It is a byte-level BPE without merges, so that it round-trips through `save_pretrained` and
    `AutoTokenizer.from_pretrained` (which loads Qwen2 checkpoints with Qwen2's byte-level tokenizer class)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [byte_level_symbol(c) for c in CHARACTERS])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS_CHAT,
                                        additional_special_tokens=[BOS_CHAT], padding_side="right")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.name_or_path = "erpo-tiny-char"
    return tokenizer


def build_model(tokenizer, seed: int, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                num_kv_heads: int = 2, intermediate_size: int = 128) -> Qwen2ForCausalLM:
    """A freshly initialised tiny Qwen2ForCausalLM (fp32, tied embeddings) for `tokenizer`'s vocabulary."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_CHAT),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_model_dir(path, tokenizer, seed: int = 0, **size) -> str:
    """`build_model(tokenizer, seed, **size)` and `tokenizer` saved as a Hugging Face model directory at `path`;
    returns `path` as a str (for trainers that take a model path: TRL, verl, `erpo train --model`)."""
    build_model(tokenizer, seed, **size).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
