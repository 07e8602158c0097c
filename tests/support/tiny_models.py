"""The tests' smallest causal LM: erpo's tiny Qwen2 at one layer and hidden size 32 (fast on a CPU), built
locally from a config with erpo's byte-level tokenizer, no download."""
from erpo.models.tiny import build_model, save_model_dir

TEST_SIZE = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


def tiny_test_model(tokenizer, seed: int = 0):
    """A Qwen2ForCausalLM of TEST_SIZE with random weights from `seed`."""
    return build_model(tokenizer, seed=seed, **TEST_SIZE)


def save_tiny_model(path, tokenizer, seed: int = 0) -> str:
    """`tiny_test_model` and `tokenizer` saved as a Hugging Face model directory at `path`; returns it as a str."""
    return save_model_dir(path, tokenizer, seed, **TEST_SIZE)
