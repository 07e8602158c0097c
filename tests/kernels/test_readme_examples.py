"""The README's Python examples run as written, on a tiny model, and give the values they claim."""
import re
from pathlib import Path

import torch

from erpo.models.tiny import build_tokenizer
from tiny_models import tiny_test_model

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def scope():
    """The names the examples take from the reader's training loop: a tiny causal LM and a padded batch."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model = tiny_test_model(tokenizer)
    batch, length = 3, 12
    input_ids = torch.randint(0, len(tokenizer), (batch, length))
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[0, :2] = 0                                   # left padding on the first sample
    response_mask = torch.zeros(batch, length, dtype=torch.long)
    response_mask[:, 7:] = 1
    return dict(model=model, input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                D=model.config.hidden_size, advantages=torch.tensor([1.0, -0.5, 0.25]),
                ref_query_logp=torch.tensor([-30.0, -25.0, -28.0]), w=torch.tensor([1.0, 1.2, 0.8]),
                old_logp=None)


def test_readme_has_the_three_examples():
    assert len(EXAMPLES) == 3


def test_logits_example_runs_and_backpropagates():
    names = scope()
    exec(EXAMPLES[0], names)
    out = names["out"]
    assert torch.isfinite(out.loss) and out.query_logp.shape == (3,)
    assert all(p.grad is not None for p in names["model"].parameters() if p.requires_grad)


def test_fused_linear_example_matches_the_logits_example():
    """Same model and batch: the fused-linear example's loss and no-grad log-probs equal the logits example's."""
    logits_names = scope()
    exec(EXAMPLES[0], logits_names)
    fused_names = {**scope(), "rows": logits_names["rows"], "torch": torch}
    exec(EXAMPLES[1], fused_names)
    torch.testing.assert_close(fused_names["out"].loss, logits_names["out"].loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused_names["ref_logp"], logits_names["out"].token_logp, rtol=1e-4, atol=1e-5)


def test_liger_style_example_matches_the_logits_example():
    """The FusedLinearERPOLoss example, on the same batch split into TRL's prompt / completion columns, gives the
    logits example's loss, and its completion-aligned log-probs are the logits example's response rows."""
    logits_names = scope()
    exec(EXAMPLES[0], logits_names)
    names = scope()
    prompt = 7   # scope()'s response_mask starts at column 7
    ids, mask, response = names["input_ids"], names["attention_mask"], names["response_mask"]
    names.update(torch=torch, prompt_ids=ids[:, :prompt], prompt_mask=mask[:, :prompt],
                 completion_ids=ids[:, prompt:], completion_mask=response[:, prompt:], old_per_token_logps=None)
    exec(EXAMPLES[2], names)
    torch.testing.assert_close(names["out"].loss, logits_names["out"].loss, rtol=1e-4, atol=1e-5)
    length = names["input_ids"].shape[1]
    response_rows = logits_names["out"].token_logp.reshape(3, length)[:, prompt - 1:length - 1]
    torch.testing.assert_close(names["out"].token_logp, response_rows, rtol=1e-4, atol=1e-5)
