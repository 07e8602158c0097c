"""The entry points for trainers that compute log-probs themselves (API.md): `logprob_erpo_loss` against `erpo_loss`
on logits that give the same log-probs (values, gradients, metrics), and `sample_sums` against the torch reference's
sums (values, gradient, determinism on the Triton path), with their errors."""
import math
import re

import numpy as np
import pytest
import torch

from erpo_kernels import erpo_loss, logprob_erpo_loss, sample_sums, token_logprobs
from helpers import loss_inputs, random_batch
from test_reference import OPTION_CASES

TRANSFORM = ("temperature", "logit_scale", "logit_softcap")


def both_losses(batch, inputs, options, backend):
    """(erpo_loss on the logits, its logits gradient, logprob_erpo_loss on their log-probs and entropies, its logits
    gradient through them), both with the tensors `inputs`: the logit transform goes to `token_logprobs`, the other
    options to the loss."""
    transform = {k: v for k, v in options.items() if k in TRANSFORM}
    rest = {k: v for k, v in options.items() if k not in TRANSFORM}
    rows = batch["targets"], batch["token_kind"], batch["sample_index"]
    logits = batch["logits"].clone().requires_grad_(True)
    expected = erpo_loss(logits, *rows, backend=backend, **inputs, **options)
    expected.loss.backward()
    scored = batch["logits"].clone().requires_grad_(True)
    logp, entropy = token_logprobs(scored, batch["targets"], return_entropy=True, backend=backend, **transform)
    out = logprob_erpo_loss(logp, *rows[1:], entropy=entropy, backend=backend, **inputs, **rest)
    out.loss.backward()
    return expected, logits.grad, out, scored.grad


def assert_same(expected, expected_grad, out, grad):
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    for name in ("query_logp", "response_logp", "token_logp"):
        torch.testing.assert_close(getattr(out, name), getattr(expected, name))
    assert out.metrics.keys() == expected.metrics.keys()
    for name, value in expected.metrics.items():
        torch.testing.assert_close(out.metrics[name], value, rtol=1e-6, atol=1e-7, equal_nan=True, msg=name)


@pytest.mark.parametrize("options", OPTION_CASES + [{"top_entropy_quantile": 0.5, "entropy_coef": 0.05},
                                                    {"pg_objective": "cispo"}, {"pg_objective": "vespo"}],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_logprob_loss_is_erpo_loss_on_the_same_log_probs(options, device):
    batch = random_batch(device=device)
    rows = batch["targets"].shape[0]
    inputs = dict(loss_inputs(batch), token_weight=(torch.rand(rows) * 2).to(device),
                  rollout_logp=batch["old_logp"] + 0.1)
    assert_same(*both_losses(batch, inputs, options, "torch"))


@pytest.mark.parametrize("options", [{}, {"entropy_coef": 0.05, "qkl_coef": 0.5}],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_on_the_triton_backend_too(options, device):
    """backend="triton" (the interpreter on CPU): the deterministic per-sample sums; the same loss as erpo_loss."""
    batch = random_batch(device=device)
    assert_same(*both_losses(batch, loss_inputs(batch), options, "triton"))


def test_without_entropy_the_loss_is_the_same_and_the_entropy_metrics_absent(device):
    batch = random_batch(device=device)
    rows = batch["token_kind"], batch["sample_index"]
    logp, entropy = token_logprobs(batch["logits"], batch["targets"], return_entropy=True)
    with_entropy = logprob_erpo_loss(logp, *rows, entropy=entropy, **loss_inputs(batch))
    without = logprob_erpo_loss(logp, *rows, **loss_inputs(batch))
    assert torch.equal(without.loss, with_entropy.loss)
    assert "entropy" not in without.metrics and without.metrics.kept_entropy is None and without.entropy.isnan().all()
    assert not math.isnan(with_entropy.metrics["entropy"]) and "kept_entropy" in with_entropy.metrics


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sample_sums_take_a_numpy_integer_count_and_name_a_bad_one(backend, device):
    """num_samples computed with numpy (np.int64 from len of an array's unique values) is the count it holds, as the
    loss's numeric options are (`validation.plain_number`), where it was refused as "not an integer >= 0, got
    np.int64(3)"; a float, a negative, a tensor or a bool is one line naming num_samples."""
    values = torch.tensor([1.0, 2.0, 4.0, 8.0], device=device)
    sample_index = torch.tensor([0, 2, 2, 1], device=device)
    expected = sample_sums(values, sample_index, 3, backend=backend)
    for count in (np.int64(3), np.int32(3), np.uint8(3)):
        torch.testing.assert_close(sample_sums(values, sample_index, count, backend=backend), expected, rtol=0, atol=0)
    for bad, shown in ((np.float64(3.0), "3.0"), (3.0, "3.0"), (np.int64(-1), "-1"), (-1, "-1"),
                       (torch.tensor(3, device="cpu"), "tensor(3)"), (True, "True")):
        with pytest.raises(ValueError, match=rf"^num_samples must be an integer >= 0, got {re.escape(shown)}$"):
            sample_sums(values, sample_index, bad, backend=backend)


# the cases' tensors are built at collection, before the `device` fixture exists: on the CPU, moved in the test
@pytest.mark.parametrize("change, error, match", [
    (dict(entropy_coef=0.1), ValueError, "entropy .* is required when entropy_coef != 0"),
    (dict(top_entropy_quantile=0.5), ValueError, "entropy .* is required"),
    (dict(temperature=0.7), ValueError, "temperature act on logits"),
    (dict(logit_softcap=30.0, logit_scale=2.0), ValueError, "logit_scale, logit_softcap act on logits"),
    (dict(token_logp=torch.zeros(48, dtype=torch.bfloat16, device="cpu")), TypeError, "token_logp must be float32"),
    (dict(token_logp=torch.zeros(48, 2, device="cpu")), ValueError, "token_logp"),
    (dict(entropy=torch.zeros(47, device="cpu")), ValueError, "entropy"),
    (dict(entropy=torch.zeros(48, dtype=torch.float16, device="cpu")), TypeError, "entropy must be float32"),
    (dict(sample_index=torch.full((48,), 9, device="cpu")), ValueError, "sample_index must lie in"),
], ids=["entropy_coef", "entropy_filter", "temperature", "transform", "bf16", "rank", "entropy_length",
        "entropy_dtype", "sample_index"])
def test_logprob_loss_errors_name_the_argument(change, error, match, device):
    batch = random_batch(device=device)
    change = {k: v.to(device) if torch.is_tensor(v) else v for k, v in change.items()}
    args = {**dict(token_logp=token_logprobs(batch["logits"], batch["targets"]), token_kind=batch["token_kind"],
                   sample_index=batch["sample_index"], **loss_inputs(batch)), **change}
    with pytest.raises(error, match=match):
        logprob_erpo_loss(args.pop("token_logp"), args.pop("token_kind"), args.pop("sample_index"), **args)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sample_sums_are_the_per_sample_sums_and_differentiable(backend, device):
    g = torch.Generator().manual_seed(1)
    values = torch.randn(300, generator=g, dtype=torch.float64).to(device).requires_grad_(True)   # cast to fp32
    sample_index = torch.randint(0, 7, (300,), generator=g).to(device)
    sums = sample_sums(values, sample_index, 8, backend=backend)
    expected = torch.zeros(8, dtype=torch.float64, device=device).index_add(0, sample_index, values.detach()).float()
    assert sums.dtype == torch.float32 and sums.shape == (8,) and sums[7] == 0   # an empty sample sums to 0
    torch.testing.assert_close(sums, expected, rtol=1e-6, atol=1e-5)
    upstream = torch.randn(8, generator=g).to(device)
    sums.backward(upstream)
    torch.testing.assert_close(values.grad, upstream[sample_index].double())


def test_sample_sums_on_the_triton_path_repeat_bit_for_bit(device):
    """Each sample's rows in a fixed order: shuffling which rows come first in memory never changes a sum's bits,
    and two calls agree exactly (index_add would add in whatever order the atomics land on a GPU)."""
    g = torch.Generator().manual_seed(2)
    values = (torch.randn(4000, generator=g) * 100).to(device)
    sample_index = torch.randint(0, 3, (4000,), generator=g).to(device)
    first = sample_sums(values, sample_index, 3, backend="triton")
    assert torch.equal(first, sample_sums(values, sample_index, 3, backend="triton"))
    # against the exact sums: fp32 sums of ~1300 terms of size ~100 in any order are off by up to n eps sum|v| /
    # sqrt(n)-ish; 4 eps sum|v| bounds a fixed-order fp32 sum here with room (the H200 gave 2.6e-3 on a sum of
    # ~3000, where an rtol of 1e-5 against torch's own fp32 order failed)
    exact = torch.zeros(3, dtype=torch.float64, device=device).index_add_(0, sample_index, values.double())
    bound = 4 * torch.finfo(torch.float32).eps * torch.zeros(3, dtype=torch.float64, device=device).index_add_(
        0, sample_index, values.double().abs())
    assert torch.all((first.double() - exact).abs() <= bound), (first, exact, bound)


# the cases' tensors are built at collection, before the `device` fixture exists: on the CPU, moved in the test
@pytest.mark.parametrize("args, error, match", [
    ((torch.zeros(4, 2, device="cpu"), torch.zeros(4, dtype=torch.long, device="cpu"), 1), ValueError, "values"),
    ((torch.zeros(4, dtype=torch.long, device="cpu"), torch.zeros(4, dtype=torch.long, device="cpu"), 1), TypeError,
     "values"),
    ((torch.zeros(4, device="cpu"), torch.zeros(3, dtype=torch.long, device="cpu"), 1), ValueError, "sample_index"),
    ((torch.zeros(4, device="cpu"), torch.zeros(4, device="cpu"), 1), TypeError, "sample_index"),
    ((torch.zeros(4, device="cpu"), torch.zeros(4, dtype=torch.long, device="cpu"), -1), ValueError, "num_samples"),
    ((torch.zeros(4, device="cpu"), torch.zeros(4, dtype=torch.long, device="cpu"), 2.0), ValueError, "num_samples"),
    ((torch.zeros(4, device="cpu"), torch.tensor([0, 1, 2, 1], device="cpu"), 2), ValueError,
     r"sample_index must lie in \[0, 2\).*row 2 holds 2"),
], ids=["values_rank", "values_dtype", "length", "index_dtype", "negative", "float_count", "out_of_range"])
def test_sample_sums_errors_name_the_argument(args, error, match, device):
    with pytest.raises(error, match=match):
        sample_sums(*(a.to(device) if torch.is_tensor(a) else a for a in args))
