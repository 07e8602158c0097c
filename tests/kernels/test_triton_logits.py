"""Triton kernels against the torch reference: values, gradients, options, dtypes. On the `device` fixture's device:
compiled on a GPU when one is present, the interpreter on CPU."""
import pytest
import torch

from erpo_kernels import erpo_loss, token_logprobs
from erpo_kernels.triton_logits import FORWARD_VARIANTS, _launch_forward, block_size_for, forward_variant
from erpo_kernels.validation import NO_TRANSFORM
from helpers import loss_inputs, random_batch
from launch_counts import LaunchCounter
from test_reference import OPTION_CASES

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
             torch.float16: dict(rtol=5e-3, atol=5e-3)}


def both_backends(batch, **options):
    results = []
    for backend in ("torch", "triton"):
        logits = batch["logits"].clone().requires_grad_(True)
        out = erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend=backend,
                        **loss_inputs(batch), **options)
        out.loss.backward()
        results.append((out, logits.grad))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2), (7, 5), (48, 37), (9, 4096 + 37)], ids=str)
def test_token_logprobs_match_reference(dtype, shape, device):
    n, v = shape
    logits = (torch.randn(n, v) * 4).to(device, dtype)
    targets = torch.randint(0, v, (n,)).to(device)
    targets[::3] = -100
    grads = []
    outs = []
    g_logp, g_entropy = torch.randn(n).to(device), torch.randn(n).to(device)
    for backend in ("torch", "triton"):
        x = logits.clone().requires_grad_(True)
        logp, entropy = token_logprobs(x, targets, temperature=0.8, return_entropy=True, backend=backend)
        ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
        outs.append((logp, entropy))
        grads.append(x.grad)
    (ref_logp, ref_entropy), (tri_logp, tri_entropy) = outs
    assert tri_logp.dtype == torch.float32 and tri_entropy.dtype == torch.float32
    torch.testing.assert_close(tri_logp, ref_logp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(tri_entropy, ref_entropy, rtol=1e-5, atol=2e-5)
    assert torch.all(tri_logp[::3] == 0)
    assert grads[1].dtype == dtype
    torch.testing.assert_close(grads[1].float(), grads[0].float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_erpo_loss_matches_reference(options, device):
    (ref, ref_grad), (tri, tri_grad) = both_backends(random_batch(device=device), **options)
    torch.testing.assert_close(tri.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tri_grad, ref_grad, rtol=1e-4, atol=1e-6)
    for name in ("token_logp", "query_logp", "response_logp", "entropy"):
        torch.testing.assert_close(getattr(tri, name), getattr(ref, name), rtol=1e-5, atol=1e-5)
    for name, value in ref.metrics.items():
        torch.testing.assert_close(tri.metrics[name], value, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_samples_without_rows_match_reference(loss_agg, device):
    """Samples 0, 2, 4, 6, 7 own no row (empty segments at the start, middle and end of the Triton per-sample sums);
    query_logp / response_logp are 0 there on both backends."""
    batch = random_batch(device=device, num_samples=8)
    odd = torch.randint(0, 3, batch["sample_index"].shape, generator=torch.Generator().manual_seed(1)).to(device)
    batch["sample_index"] = 2 * odd + 1
    (torch_out, torch_grad), (triton_out, triton_grad) = both_backends(batch, loss_agg=loss_agg,
                                                                         ratio_level="sequence")
    for name in ("query_logp", "response_logp"):
        torch.testing.assert_close(getattr(triton_out, name), getattr(torch_out, name), **TOLERANCE[torch.float32])
        assert getattr(triton_out, name)[[0, 2, 4, 6, 7]].eq(0).all()
    assert torch_out.query_logp[[1, 3, 5]].lt(0).all()
    torch.testing.assert_close(triton_out.loss, torch_out.loss, **TOLERANCE[torch.float32])
    torch.testing.assert_close(triton_grad, torch_grad, **TOLERANCE[torch.float32])


def test_bf16_logits_with_bf16_gradient(device):
    (ref, ref_grad), (tri, tri_grad) = both_backends(random_batch(device=device, dtype=torch.bfloat16), qkl_coef=0.1)
    torch.testing.assert_close(tri.loss, ref.loss, rtol=1e-5, atol=1e-5)
    assert tri_grad.dtype == torch.bfloat16
    torch.testing.assert_close(tri_grad.float(), ref_grad.float(), rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("variant", FORWARD_VARIANTS)
def test_bf16_gradient_is_the_fp32_one_rounded_to_nearest(variant, device):
    """bf16 logits are read exactly into fp32 and their d logits formed in fp32, so the bf16 d logits are the fp32
    logits' d logits rounded once to nearest even (torch's rounding, the compiled cast's), bit for bit. Triton's
    interpreter truncates instead (up to a whole ulp toward zero on about half the entries) unless held to the
    compiled rounding (tests/support/interpreter_as_gpu.py, this tier's conftest)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(24, 333, generator=g) * 4).to(device, torch.bfloat16)
    targets = torch.randint(0, 333, (24,), generator=g).to(device)
    upstream = torch.randn(2, 24, generator=g).to(device)   # d loss / d logp, d loss / d H
    grads = []
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype).requires_grad_(True)
        with forward_variant(variant):
            logp, entropy = token_logprobs(x, targets, return_entropy=True, backend="triton")
            (grad,) = torch.autograd.grad((logp * upstream[0] + entropy * upstream[1]).sum(), x)
        grads.append(grad)
    fp32, bf16 = grads
    assert bf16.dtype == torch.bfloat16 and not torch.equal(fp32, bf16.float())   # rounding happened
    assert torch.equal(bf16.view(torch.int16), fp32.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("variant", FORWARD_VARIANTS)
def test_target_gradient_exact_in_bf16(variant, device):
    """A confident row (p_target ~ 1 - 1e-3): the target's gradient g * (1 - p) is formed in fp32 and rounded
    once, not read back from a bf16 softmax and subtracted (which would give 0 or a 100% error); every variant's
    backward."""
    logits = torch.zeros(1, 64, device=device)
    logits[0, 5] = 10.0
    logits = logits.to(device, torch.bfloat16).requires_grad_(True)
    with forward_variant(variant):
        logp = token_logprobs(logits, torch.tensor([5], device=device), backend="triton")
    logp.sum().backward()
    z = logits.detach().double()
    expected = 1 - torch.softmax(z, -1)[0, 5]
    assert logits.grad[0, 5].double().item() == pytest.approx(expected.item(), rel=1e-2)


def test_inplace_backward_writes_gradient_into_logits(device):
    batch = random_batch(device=device)
    (_, ref_grad), _ = both_backends(batch)
    logits = batch["logits"].clone().requires_grad_(True)
    buffer = logits * 1.0  # a non-leaf, as logits are in a model
    out = erpo_loss(buffer, batch["targets"], batch["token_kind"], batch["sample_index"], backend="triton",
                    inplace_backward=True, **loss_inputs(batch))
    out.loss.backward()
    torch.testing.assert_close(logits.grad, ref_grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(buffer.detach(), ref_grad, rtol=1e-4, atol=1e-6)  # the buffer now holds dlogits


def test_non_contiguous_logits(device):
    base = torch.randn(40, 2 * 37).to(device)
    logits = base[::2, ::2]  # both strides non-unit
    targets = torch.randint(0, 37, (20,)).to(device)
    ref = token_logprobs(logits.contiguous(), targets, backend="torch")
    tri = token_logprobs(logits, targets, backend="triton")
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)
    x = logits.clone().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(True)  # column-major
    token_logprobs(x, targets, backend="triton").sum().backward()
    y = logits.contiguous().requires_grad_(True)
    token_logprobs(y, targets, backend="torch").sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-6)


def test_deterministic_and_batch_invariant(device):
    batch = random_batch(device=device, dtype=torch.bfloat16)
    runs = [both_backends(batch, qkl_coef=0.1)[1] for _ in range(2)]
    assert torch.equal(runs[0][0].loss, runs[1][0].loss) and torch.equal(runs[0][1], runs[1][1])
    for name in ("token_logp", "query_logp", "entropy"):
        assert torch.equal(getattr(runs[0][0], name), getattr(runs[1][0], name))
    # A row's log-prob and entropy do not change when other rows join the call.
    logits, targets = batch["logits"], batch["targets"]
    alone_logp, alone_entropy = token_logprobs(logits[:5], targets[:5], return_entropy=True, backend="triton")
    more = torch.cat([logits[:5], torch.randn(30, logits.shape[1]).to(device, logits.dtype)])
    more_targets = torch.cat([targets[:5], torch.randint(0, logits.shape[1], (30,)).to(device)])
    all_logp, all_entropy = token_logprobs(more, more_targets, return_entropy=True, backend="triton")
    assert torch.equal(all_logp[:5], alone_logp) and torch.equal(all_entropy[:5], alone_entropy)


def test_no_grad_saves_nothing_and_matches(device):
    batch = random_batch(device=device)
    logits = batch["logits"].clone().requires_grad_(True)
    with torch.no_grad():
        logp = token_logprobs(logits, batch["targets"], backend="triton")
    assert logp.grad_fn is None and not logp.requires_grad
    torch.testing.assert_close(logp, token_logprobs(batch["logits"], batch["targets"], backend="torch"))


def test_nonfinite_logits_give_nan_loss_and_a_flag(device):
    batch = random_batch(device=device)
    batch["logits"][1, 4] = float("nan")  # row 1 is a response row
    batch["logits"][2, 0] = float("inf")  # row 2 is not scored: ignored
    for backend in ("torch", "triton"):
        out = erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"],
                        backend=backend, **loss_inputs(batch))
        assert torch.isnan(out.loss) and out.metrics["nonfinite_rows"].item() == 1
    batch["logits"][1, 4] = 0.0
    batch["logits"][0, 0] = float("inf")  # row 0 is a query row: the loss is NaN even with qkl_coef = 0
    out = erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"],
                    backend="triton", qkl_coef=0.0, **loss_inputs(batch))
    assert torch.isnan(out.loss) and out.metrics["nonfinite_rows"].item() == 1


@pytest.mark.parametrize("variant", list(FORWARD_VARIANTS))
def test_a_nan_logit_makes_its_rows_logp_entropy_and_lse_nan(device, variant):
    """A NaN logit anywhere in a row (before or after the row's max, in its first or a later vocabulary step, the
    target itself, the whole row) makes that row's logp, entropy and lse NaN, as in the reference; other rows keep
    their values. The running max skips the NaN (tl.max does, and compiled so does tl.maximum: this tier's
    interpreter drops it too, tests/support/interpreter_as_gpu.py); exp(z - m) carries it into s and u."""
    widest = FORWARD_VARIANTS[variant].widest
    vocab = 2 * block_size_for(10**6, widest) + 5  # three steps, the last one partial
    logits = torch.randn(6, vocab, device=device) * 3
    targets = torch.tensor([2, 2, 2, 7, 2, 2], device=device)
    logits[1, 0] = 30.0  # the row's max, in its first step
    nan_at = {0: 1, 1: vocab - 1, 3: 7, 4: widest + 3}  # row -> column: early, after the max, the target, 2nd step
    for row, column in nan_at.items():
        logits[row, column] = float("nan")
    logits[5] = float("nan")
    with forward_variant(variant):
        logp, entropy, lse = _launch_forward(logits, targets, NO_TRANSFORM)
    ref_logp, ref_entropy = token_logprobs(logits, targets, backend="torch", return_entropy=True)
    ref_lse = logits.logsumexp(dim=1)
    nan_rows = torch.tensor([row in nan_at or row == 5 for row in range(6)], device=device)
    for name, value, reference in (("logp", logp, ref_logp), ("entropy", entropy, ref_entropy),
                                   ("lse", lse, ref_lse)):
        assert torch.equal(reference.isnan(), nan_rows), name  # the reference's own NaN rows, as intended
        assert torch.equal(value.isnan(), nan_rows), (name, value)
        torch.testing.assert_close(value[~nan_rows], reference[~nan_rows], rtol=1e-5, atol=1e-5)


def test_rows_without_gradient_get_exact_zeros_even_with_nonfinite_logits(device):
    """Padding rows (kind 0) and the response rows of a zero-advantage sample receive no gradient. Non-finite
    logits in padding rows (e.g. fully masked attention) must leave the update finite: their gradient rows are
    exactly zero (no 0 * NaN) and every other row's gradient is what it is with clean logits."""
    batch = random_batch(device=device)
    batch["advantages"][1] = 0.0
    padding = (batch["token_kind"] == 0).nonzero().flatten()
    silent = ((batch["token_kind"] == 2) & (batch["sample_index"] == 1)).nonzero().flatten()
    assert len(padding) >= 2 and len(silent) >= 1
    dirty = batch["logits"].clone()
    dirty[padding[0], 0] = float("inf")
    dirty[padding[1]] = float("nan")
    others = torch.ones(len(dirty), dtype=torch.bool, device=device)
    others[padding] = False
    for backend in ("torch", "triton"):
        grads = []
        for logits in (batch["logits"], dirty):
            x = logits.clone().requires_grad_(True)
            out = erpo_loss(x, batch["targets"], batch["token_kind"], batch["sample_index"], backend=backend,
                            **loss_inputs(batch))
            assert torch.isfinite(out.loss)
            out.loss.backward()
            grads.append(x.grad)
        clean, got = grads
        assert torch.isfinite(got).all(), backend
        assert torch.all(got[padding] == 0) and torch.all(clean[silent] == 0), backend
        torch.testing.assert_close(got[others], clean[others], rtol=0, atol=0)


@pytest.mark.parametrize("transform", [dict(temperature=0.7), dict(logit_softcap=1000.0, temperature=0.9)],
                         ids=["plain", "soft-capped"])
@pytest.mark.parametrize("variant", FORWARD_VARIANTS)
def test_entropy_is_never_negative_nor_logp_positive(variant, transform, device, fma_as_compiled):
    """Peaked rows (one logit 40 to 400 above the rest, each in a different loop step, targets on and off the max):
    in every kernel the max's term is exactly 1, so s >= 1 and u <= 0, entropy >= 0 and logp <= 0 as the math says,
    where a rounding of the max's shift gave -7.3e-8 on the H200 (under the interpreter with the GPU's FMA
    contraction)."""
    n, v = 32, 2 * 2048 + 37
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(n, v, generator=generator).to(device)
    rows = torch.arange(n, device=device)
    peaks = (torch.rand(n, generator=generator) * v).long().to(device)
    logits[rows, peaks] = (40 + torch.rand(n, generator=generator) * 360).to(device)
    targets = torch.where(rows % 2 == 0, peaks, (peaks + 1) % v)
    with forward_variant(variant):
        logp, entropy = token_logprobs(logits, targets, return_entropy=True, backend="triton", **transform)
    assert torch.all(entropy >= 0) and torch.all(logp <= 0), (entropy.min(), logp.max())


def test_block_size_depends_on_vocabulary_only():
    assert block_size_for(37) == 64 and block_size_for(4096) == 4096 and block_size_for(152064) == 4096


@pytest.mark.parametrize("transform", [dict(temperature=0.8),
                                       dict(logit_scale=1.7, logit_softcap=6.0, temperature=1.3)],
                         ids=["plain", "soft-capped"])
@pytest.mark.parametrize("variant", FORWARD_VARIANTS)
def test_every_kernel_variant_matches_reference(variant, transform, device, fma_as_compiled):
    """Each variant's forward and backward (bench's erpo-* contenders) against the reference, on rows that span
    several loop steps and end in a partial one (V = 2 * 2048 + 37), with a row whose leading and trailing logits
    are -inf (a masked vocabulary: the -inf must neither poison the sums, the entropy nor the gradient), a row of one
    finite logit (entropy 0), rows far from 0 (the running max rescales) and a row that receives no gradient. The
    backward runs after the variant's block: it is the variant of the forward that formed the loss. Under the
    interpreter with the GPU's FMA contraction (`fma_as_compiled`)."""
    n, v = 7, 2 * 2048 + 37
    logits = (torch.randn(n, v) * 4).to(device)
    logits[1, :3000] = float("-inf")
    logits[1, -5:] = float("-inf")
    logits[2] = float("-inf")
    logits[2, 77] = 3.3  # times 1 / 0.8 (or log2 e) not a float: the GPU's rounding of a product must not show
    logits[3] += 60.0
    logits[4, -1] = 40.0  # the row's max in its last, partial step
    targets = torch.tensor([5, 3100, 77, v - 1, v - 1, -100, 9], device=device)
    g_logp, g_entropy = torch.randn(n).to(device), torch.randn(n).to(device)
    g_logp[6] = g_entropy[6] = 0.0
    results = []
    for backend in ("torch", "triton"):
        leaf = logits.clone().requires_grad_(True)
        with forward_variant(variant):
            logp, entropy = token_logprobs(leaf, targets, return_entropy=True, backend=backend, **transform)
        with LaunchCounter() as counter:
            ((g_logp * logp).sum() + (g_entropy * entropy).sum()).backward()
        if backend == "triton":
            assert counter.names[f"triton.{FORWARD_VARIANTS[variant].backward.__name__}"] == 1, counter.names
        results.append((logp, entropy, leaf.grad))
    (ref_logp, ref_entropy, ref_grad), (logp, entropy, grad) = results
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=2e-5)
    # atol 4e-6: the base-2 backward forms exp2(z * log2(e) - lse * log2(e)) in one FMA, whose rounding is an ulp
    # of lse * log2(e) (3.8e-6 at the row max 40 of row 4), and the GPU's exp2 is approximate: there p of the row's
    # max logit is 1 - 2.6e-6 where fp32 rounds the reference's to 1, a gradient of 1.3e-6 where the reference has
    # 0 (H200, 2026-11-26; by the same rounding row 2's one logit, where p = 1, can get one of that order); the
    # shifted loops and the interpreter stay within 1e-6
    # soft-capped, row 2 (one finite logit beside 4108 -inf ones that the cap makes equal) is where the oracle errs:
    # at the finite logit the torch reference's fp32 gradient is 1.9e-5 off the same gradient formed in float64 on an
    # AMD EPYC CPU (2026-11-28, seed 0; within 4e-6 on the CPUs before), the interpreted kernel's 4.9e-7
    grad_atol = 2.5e-5 if "logit_softcap" in transform else 4e-6
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=grad_atol)
    assert logp[5] == 0 and torch.all(grad[6] == 0)
    if "logit_softcap" not in transform:  # a soft-cap makes -inf a finite -c: row 2 then has a spread
        # exact, as in the reference: every forward kernel forms the max's shift from itself as exactly 0 (on the
        # H200, 2026-11-26, the base-2 loop then subtracted a rounded product and gave this row entropy -7.3e-8)
        assert entropy[2] == 0 and logp[2] == 0 and torch.all(grad[1, :3000] == 0)
