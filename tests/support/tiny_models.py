"""The tests' smallest causal LM: erpo's tiny Qwen2 at one layer and hidden size 32 (fast on a CPU), built
locally from a config with erpo's byte-level tokenizer, no download."""
from tokenizers import processors

from erpo.models.tiny import PAD, build_model, build_tokenizer, save_model_dir

TEST_SIZE = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


def tiny_test_model(tokenizer, seed: int = 0):
    """A Qwen2ForCausalLM of TEST_SIZE with random weights from `seed`."""
    return build_model(tokenizer, seed=seed, **TEST_SIZE)


def save_tiny_model(path, tokenizer, seed: int = 0) -> str:
    """`tiny_test_model` and `tokenizer` saved as a Hugging Face model directory at `path`; returns it as a str."""
    return save_model_dir(path, tokenizer, seed, **TEST_SIZE)


# A chat template that writes the BOS and reads Qwen3's `enable_thinking` (False: an empty thought after the
# generation prompt)
BOS_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def bos_chat_tokenizer():
    """erpo's tiny tokenizer made the hard case for a prompt's first token: its BOS is its pad token (a left-padded
    prompt's first real token has the pad id), written by the chat template (BOS_CHAT_TEMPLATE) and added to bare text
    by the tokenizer too. The same vocabulary: `tiny_test_model` fits it."""
    tokenizer = build_tokenizer()
    tokenizer.bos_token = PAD
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{PAD} $A", pair=f"{PAD} $A {PAD} $B", special_tokens=[(PAD, tokenizer.bos_token_id)])
    tokenizer.chat_template = BOS_CHAT_TEMPLATE
    return tokenizer
