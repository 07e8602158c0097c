"""Fused linear -> log-probs / ERPO loss (both backends) against the logits path, on the `device` fixture's device:
Triton compiled on a GPU when one is present, the interpreter on CPU."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton` (also done by conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402

import erpo_kernels.fused_linear_loss as fused_linear_loss  # noqa: E402
from erpo_kernels.api import erpo_loss  # noqa: E402
from erpo_kernels.fused_linear import (  # noqa: E402
    fused_linear_backward_op,
    fused_linear_erpo_loss,
    fused_linear_op,
    fused_linear_token_logprobs,
)
from erpo_kernels.reference import reference_token_logprobs  # noqa: E402
from erpo_kernels.validation import LogitTransform  # noqa: E402
from helpers import loss_inputs, random_batch  # noqa: E402
from max_allocation import LargestAllocation  # noqa: E402
from test_fused_linear_loss import budget_for, grad_hidden_fp32  # noqa: E402, F401  (the fixture: d hidden both ways)
from test_reference import OPTION_CASES  # noqa: E402

BACKENDS = ["torch", "triton"]
GRAD_TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=2e-2),
                  torch.float16: dict(rtol=5e-3, atol=5e-3)}


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """fused_linear_token_logprobs' chunks far smaller than N (a few rows each), so every chunk loop and tail runs."""
    monkeypatch.setattr(fused_linear_loss, "DEFAULT_WORKSPACE_BYTES", 30_000)


def make_linear(num_rows, hidden_dim, vocab, dtype, *, device, bias=True, seed=1):
    """hidden [N, D], weight [V, D] (logits of std ~2) and bias [V] or None, drawn on the CPU (the same numbers on
    every device), then moved to `device` in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_rows, hidden_dim, generator=g).to(device, dtype)
    weight = (torch.randn(vocab, hidden_dim, generator=g) * 2.0 / hidden_dim ** 0.5).to(device, dtype)
    b = (torch.randn(vocab, generator=g) * 0.5).to(device, dtype) if bias else None
    return hidden, weight, b


def leaves(*tensors):
    return [None if t is None else t.clone().requires_grad_(True) for t in tensors]


def logits_of(hidden, weight, bias):
    """The materialized fp32 logits the fused functions must agree with."""
    logits = hidden.float() @ weight.float().t()
    return logits if bias is None else logits + bias.float()


def grads_of(tensors):
    return [None if t is None else t.grad for t in tensors]


def assert_grads_close(actual, expected, dtype):
    for got, want in zip(actual, expected):
        if want is None:
            assert got is None
            continue
        assert got.dtype == dtype
        scale = want.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(got.float() / scale, want.float() / scale, **GRAD_TOLERANCE[dtype])


@pytest.mark.parametrize("backend,dtype,bias", [
    ("torch", torch.float32, True), ("torch", torch.bfloat16, True), ("torch", torch.float32, False),
    ("torch", torch.float16, True), ("triton", torch.float32, True), ("triton", torch.bfloat16, True),
    ("triton", torch.float32, False)], ids=str)
def test_token_logprobs_and_gradients_match_logits_path(backend, dtype, bias, device):
    num_rows, hidden_dim, vocab = 40, 48, 300
    hidden, weight, b = make_linear(num_rows, hidden_dim, vocab, dtype, bias=bias, device=device)
    targets = torch.randint(0, vocab, (num_rows,)).to(device)
    targets[::7] = -100
    g_logp, g_entropy = torch.randn(num_rows).to(device), torch.randn(num_rows).to(device)

    ours = leaves(hidden, weight, b)
    logp, entropy = fused_linear_token_logprobs(ours[0], ours[1], targets, bias=ours[2], temperature=0.7,
                                                return_entropy=True, backend=backend)
    ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()

    ref = leaves(hidden.float(), weight.float(), None if b is None else b.float())
    ref_logp, ref_entropy = reference_token_logprobs(logits_of(*ref), targets, LogitTransform(temperature=0.7))
    ((ref_logp * g_logp).sum() + (ref_entropy * g_entropy).sum()).backward()

    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == (num_rows,)
    torch.testing.assert_close(logp, ref_logp.detach(), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=1e-5, atol=2e-5)
    assert bool((logp[targets == -100] == 0).all()) and bool((logp <= 0).all())
    assert_grads_close(grads_of(ours), grads_of(ref), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_the_needed_gradients_are_formed(backend, device):
    """Frozen hidden (e.g. a probe on cached states) and logp only, no bias: d weight alone, still exact."""
    hidden, weight, _ = make_linear(24, 32, 130, torch.float32, bias=False, device=device)
    targets = torch.randint(0, 130, (24,)).to(device)
    w = weight.clone().requires_grad_(True)
    fused_linear_token_logprobs(hidden, w, targets, backend=backend).sum().backward()
    w_ref = weight.clone().requires_grad_(True)
    reference_token_logprobs(hidden @ w_ref.t(), targets)[0].sum().backward()
    assert_grads_close([w.grad], [w_ref.grad], torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.usefixtures("grad_hidden_fp32")
def test_confident_target_gradient_survives_bf16(backend, device):
    """p_target up to ~0.998: the target entry g (1 - p_t) must be formed in fp32. Formed as onehot - bf16(p)
    (the in-place bf16 bug of Liger PR #1329) it is 0 or ~4e-3, and d hidden = sum_j p_j (W_t - W_j) is then
    wrong by O(100%); the check below shows that on the same inputs."""
    num_rows, hidden_dim, vocab = 16, 32, 130
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(vocab, hidden_dim, generator=g) / hidden_dim ** 0.5).to(device)
    targets = torch.randint(0, vocab, (num_rows,), generator=g).to(device)
    hidden = (12.0 * weight[targets] / weight[targets].norm(dim=1, keepdim=True) ** 2).bfloat16()
    weight = weight.bfloat16()
    exact_hidden = hidden.double().requires_grad_(True)
    exact_logp = reference_token_logprobs(exact_hidden @ weight.double().t(), targets)[0]
    exact_logp.sum().backward()
    exact = exact_hidden.grad
    p_target = exact_logp.detach().exp()
    assert 0.9 < float(p_target.min()) and float(p_target.max()) > 0.995

    def worst_row_error(grad):
        return float(((grad.double() - exact).norm(dim=1) / exact.norm(dim=1)).max())

    ours = hidden.clone().requires_grad_(True)
    fused_linear_token_logprobs(ours, weight, targets, backend=backend).sum().backward()
    assert worst_row_error(ours.grad) < 2e-2
    probs = torch.softmax(hidden.float() @ weight.float().t(), dim=-1).bfloat16()
    cancelled = (torch.nn.functional.one_hot(targets, vocab).bfloat16() - probs).float() @ weight.float()
    assert worst_row_error(cancelled) > 0.3


@pytest.mark.usefixtures("grad_hidden_fp32")
def test_fp16_keeps_tiny_logit_gradients(device):
    """fp16 inputs with a token-mean-sized upstream gradient (1e-5) and a flat softmax: every non-target entry
    g p_j / T is below fp16's smallest subnormal, so each chunk's fp16 dlogits are scaled by a power of two and
    unscaled in the GEMMs. The weight gradient then matches float64 (unscaled it loses ~4%); the hidden gradient,
    itself near fp16's subnormal range, is no worse than the torch path's."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(40, 48, generator=g).to(device, torch.float16)
    weight = (torch.randn(300, 48, generator=g) * 0.05).to(device, torch.float16)
    targets = torch.randint(0, 300, (40,), generator=g).to(device)
    exact = leaves(hidden.double(), weight.double())
    (reference_token_logprobs(exact[0] @ exact[1].t(), targets)[0] * 1e-5).sum().backward()

    def relative_errors(backend):
        ours = leaves(hidden, weight)
        (fused_linear_token_logprobs(ours[0], ours[1], targets, backend=backend) * 1e-5).sum().backward()
        return [float((x.grad.double() - y.grad).norm() / y.grad.norm()) for x, y in zip(ours, exact)]

    hidden_error, weight_error = relative_errors("triton")
    assert weight_error < 1.5e-2
    assert hidden_error <= relative_errors("torch")[0] + 5e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_dhidden_is_rounded_once_to_hidden_s_dtype(backend, monkeypatch, device):
    """fused_linear_token_logprobs' backward with GRAD_HIDDEN_FP32 (bf16 inputs, chunks of a few rows): its op gives d
    hidden in bf16, as its fake says (opcheck), the product of the chunks' fp32 d hidden rounded once: the same as
    the bf16 GEMM's output here (the CPU's, or cuBLAS's, rounds once at these sizes), but for an element or two where
    the GEMMs' fp32 sums fall on either side of a rounding boundary."""
    hidden, weight, bias = make_linear(40, 48, 300, torch.bfloat16, device=device)
    targets = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2)).to(device)
    g_logp, g_entropy = (torch.randn(40, generator=torch.Generator().manual_seed(seed)).to(device) for seed in (3, 4))
    logp, entropy, lse = fused_linear_op(hidden, weight, bias, targets, 0.7, 1.0, None, backend)
    arguments = (hidden, weight, bias, targets, lse, entropy, g_logp, g_entropy, 0.7, 1.0, None, backend,
                 True, True, True)
    grads = {}
    for fp32 in (False, True):
        monkeypatch.setattr(fused_linear_loss, "GRAD_HIDDEN_FP32", fp32)
        grads[fp32] = fused_linear_backward_op(*arguments)
        assert [grad.dtype for grad in grads[fp32]] == [torch.bfloat16] * 3
    torch.library.opcheck(fused_linear_backward_op, arguments)
    assert int((grads[False][0] != grads[True][0]).sum()) <= 2
    assert all(torch.equal(as_hidden, fp32) for as_hidden, fp32 in zip(grads[False][1:], grads[True][1:]))


def erpo_both_ways(batch, hidden, weight, bias, backend, **options):
    """(fused LossOutput, its grads) and (logits-path LossOutput, its grads) on the same batch."""
    ours = leaves(hidden, weight, bias)
    out = fused_linear_erpo_loss(ours[0], ours[1], batch["targets"], batch["token_kind"], batch["sample_index"],
                                 bias=ours[2], backend=backend, **loss_inputs(batch), **options)
    out.loss.backward()
    ref = leaves(hidden.float(), weight.float(), None if bias is None else bias.float())
    expected = erpo_loss(logits_of(*ref), batch["targets"], batch["token_kind"], batch["sample_index"],
                         backend="torch", **loss_inputs(batch), **options)
    expected.loss.backward()
    return (out, grads_of(ours)), (expected, grads_of(ref))


def assert_outputs_close(out, expected):
    torch.testing.assert_close(out.loss, expected.loss.detach(), rtol=1e-5, atol=1e-5)
    for name in ("token_logp", "query_logp", "response_logp", "entropy"):
        torch.testing.assert_close(getattr(out, name), getattr(expected, name), rtol=1e-5, atol=5e-5)
    assert set(out.metrics) == set(expected.metrics)
    for name, value in expected.metrics.items():
        torch.testing.assert_close(out.metrics[name].float(), value.float(), rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_erpo_loss_every_option_torch_backend(options, device):
    batch = random_batch(num_rows=48, vocab=300, device=device)
    hidden, weight, bias = make_linear(48, 40, 300, torch.float32, device=device)
    (out, grads), (expected, expected_grads) = erpo_both_ways(batch, hidden, weight, bias, "torch", **options)
    assert_outputs_close(out, expected)
    assert_grads_close(grads, expected_grads, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_erpo_loss_triton_backend(dtype, device):
    options = {"qkl_estimator": "k3", "qkl_coef": 0.5, "policy_kl_coef": 0.1, "dual_clip": 3.0,
               "temperature": 0.6, "entropy_coef": 0.05, "loss_agg": "seq-mean-token-mean"}
    batch = random_batch(num_rows=48, vocab=300, device=device)
    hidden, weight, bias = make_linear(48, 40, 300, dtype, device=device)
    token_weight = (torch.rand(48, generator=torch.Generator().manual_seed(2)) * 2).to(device)
    (out, grads), (expected, expected_grads) = erpo_both_ways(batch, hidden, weight, bias, "triton",
                                                              token_weight=token_weight, **options)
    assert_outputs_close(out, expected)
    assert_grads_close(grads, expected_grads, dtype)


def test_erpo_loss_triton_backend_parity_options(device):
    """The options for parity with TRL / verl (in the shared objective) on the fused Triton path."""
    options = {"policy_kl_coef": 0.1, "policy_kl_bias_correction": True, "kl_clamp": 2.0, "qkl_coef": 0.5,
               "pg_log_ratio_clamp": 1.0, "entropy_coef": 0.05, "entropy_agg": "token-mean",
               "loss_agg": "seq-mean-token-sum"}
    batch = random_batch(num_rows=48, vocab=300, device=device)
    hidden, weight, bias = make_linear(48, 40, 300, torch.float32, device=device)
    (out, grads), (expected, expected_grads) = erpo_both_ways(batch, hidden, weight, bias, "triton", **options)
    assert_outputs_close(out, expected)
    assert_grads_close(grads, expected_grads, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_padding_hidden_state_leaves_the_gradients_finite(backend, device):
    """A padding row (kind 0) whose hidden state is NaN (fully masked attention) receives no gradient: d hidden is
    exactly zero there, and d weight, d bias and the other rows are what they are with that row zeroed."""
    batch = random_batch(num_rows=48, vocab=300, device=device)
    hidden, weight, bias = make_linear(48, 40, 300, torch.float32, device=device)
    padding = int((batch["token_kind"] == 0).nonzero()[0])
    results = []
    for filler in (0.0, float("nan")):
        h, w, b = leaves(hidden, weight, bias)
        with torch.no_grad():
            h[padding] = filler
        out = fused_linear_erpo_loss(h, w, batch["targets"], batch["token_kind"], batch["sample_index"], bias=b,
                                     backend=backend, **loss_inputs(batch))
        assert torch.isfinite(out.loss)
        out.loss.backward()
        results.append(grads_of([h, w, b]))
    for clean, got in zip(*results):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, clean, rtol=1e-6, atol=1e-7)
    assert torch.all(results[1][0][padding] == 0)


# N > 8 D and V > 8 D, so the inputs and gradients ([N, D], [V, D]) stay under the N * V / 8 threshold.
MEMORY_SHAPE = dict(num_rows=144, hidden_dim=16, vocab=300)


def memory_case(backend, device, **options):
    """A fwd+bwd of the fused loss at MEMORY_SHAPE in bf16 (`options`: fused_linear_erpo_loss's), as a function."""
    n, d, v = MEMORY_SHAPE.values()
    batch = random_batch(num_rows=n, vocab=v, device=device)
    hidden, weight, bias = leaves(*make_linear(n, d, v, torch.bfloat16, device=device))

    def run():
        fused_linear_erpo_loss(hidden, weight, batch["targets"], batch["token_kind"], batch["sample_index"],
                               bias=bias, backend=backend, entropy_coef=0.1, **options,
                               **loss_inputs(batch)).loss.backward()
        assert hidden.grad is not None and weight.grad is not None and bias.grad is not None
    return run


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_allocation_of_order_n_times_v_forward_or_backward(backend, device):
    """With a workspace of 8-row chunks (N = 144), no allocation, inside the custom ops included, reaches an eighth
    of the fp32 logits [N, V]: the largest is the fp32 d weight accumulator [V, D] or a chunk's buffers (on the
    Triton backend the whole budget is under it, so whatever a session's --fused-options geometry)."""
    n, d, v = MEMORY_SHAPE.values()
    budget = budget_for(8, torch.bfloat16, device, backend, vocab=v, hidden_dim=d)
    run = memory_case(backend, device, workspace_bytes=budget)
    if device.type == "cuda":  # autotune first: its timing runs allocate a 256 MB cache-flush buffer of their own
        run()
    with LargestAllocation() as recorder:
        run()
    assert recorder.events > 0
    assert recorder.largest_bytes < n * v * 4 // 8, f"an allocation of {recorder.largest_bytes} bytes"


def test_the_allocation_recorder_sees_inside_the_custom_ops(device):
    """The recorder does see an [N, V] fp32 buffer when one is made inside erpo_kernels' op (so the test above can
    fail, where a dispatch mode, `MaxAllocation`, would see the op's outputs alone): the default 1 GiB workspace holds
    every row of MEMORY_SHAPE in one chunk, whose logits are [N, V] fp32."""
    n, d, v = MEMORY_SHAPE.values()
    run = memory_case("triton", device)
    if device.type == "cuda":
        run()
    with LargestAllocation() as allocations:
        run()
    assert allocations.largest_bytes >= n * v * 4


class CountSaved(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self):
        self.count = 0

        def pack(t):
            self.count += 1
            return t

        super().__init__(pack, lambda t: t)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_saves_nothing(backend, device):
    hidden, weight, bias = leaves(*make_linear(8, 16, 50, torch.float32, device=device))
    targets = torch.randint(0, 50, (8,)).to(device)
    saved = CountSaved()
    with torch.no_grad(), saved:
        logp, entropy = fused_linear_token_logprobs(hidden, weight, targets, bias=bias, return_entropy=True,
                                                    backend=backend)
    assert saved.count == 0 and logp.grad_fn is None and entropy.grad_fn is None
    saved = CountSaved()
    with saved:
        logp_grad, entropy_grad = fused_linear_token_logprobs(hidden, weight, targets, bias=bias,
                                                              return_entropy=True, backend=backend)
    assert saved.count > 0 and logp_grad.grad_fn is not None
    assert torch.equal(logp, logp_grad.detach()) and torch.equal(entropy, entropy_grad.detach())


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_embedding_gradients_add_up(backend, device):
    """A tiny LM whose lm_head is its input embedding: the fused loss gives the tied weight the same gradient
    (input-embedding part + lm_head part) as the logits path."""
    vocab, dim, seq = 130, 16, 40

    class TinyTiedLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.mix = torch.nn.Linear(dim, dim)
            self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
            self.lm_head.weight = self.embed.weight

        def hidden(self, ids):
            return torch.tanh(self.mix(self.embed(ids)))

    ids = torch.randint(0, vocab, (seq + 1,)).to(device)
    model = TinyTiedLM().to(device)
    assert model.lm_head.weight is model.embed.weight
    fused = fused_linear_token_logprobs(model.hidden(ids[:-1]), model.lm_head.weight, ids[1:], backend=backend)
    fused.sum().backward()
    fused_grad = model.embed.weight.grad.clone()
    model.zero_grad()
    reference_token_logprobs(model.lm_head(model.hidden(ids[:-1])), ids[1:])[0].sum().backward()
    assert_grads_close([fused_grad], [model.embed.weight.grad], torch.float32)
    # Both parts are really there: the gradient is not the lm_head part alone.
    head_only = torch.autograd.grad(
        fused_linear_token_logprobs(model.hidden(ids[:-1]).detach(), model.lm_head.weight, ids[1:],
                                    backend=backend).sum(), model.lm_head.weight)[0]
    assert not torch.allclose(head_only, fused_grad, atol=1e-4)


def test_triton_backend_is_deterministic(device):
    hidden, weight, bias = make_linear(40, 48, 300, torch.bfloat16, device=device)
    targets = torch.randint(0, 300, (40,)).to(device)
    runs = []
    for _ in range(2):
        h, w, b = leaves(hidden, weight, bias)
        logp, entropy = fused_linear_token_logprobs(h, w, targets, bias=b, return_entropy=True, backend="triton")
        (logp.sum() + 0.3 * entropy.sum()).backward()
        runs.append([logp, entropy, h.grad, w.grad, b.grad])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_nonfinite_hidden_row_gives_nan_loss_and_flag(device):
    batch = random_batch(num_rows=48, vocab=300, device=device)
    hidden, weight, bias = make_linear(48, 40, 300, torch.float32, device=device)
    hidden[0, 3] = float("nan")  # row 0 is a query row in random_batch
    out = fused_linear_erpo_loss(hidden, weight, batch["targets"], batch["token_kind"], batch["sample_index"],
                                 bias=bias, backend="torch", **loss_inputs(batch))
    assert torch.isnan(out.loss) and out.metrics["nonfinite_rows"].item() == 1
    assert bool(torch.isfinite(out.token_logp[1:]).all())


@pytest.mark.parametrize("case,error,match", [
    ("hidden_rank", ValueError, "hidden must have 2"),
    ("weight_rank", ValueError, "weight must have 2"),
    ("hidden_dim_mismatch", ValueError, "D = hidden.shape"),
    ("dtype_mismatch", TypeError, "weight dtype"),
    ("integer_hidden", TypeError, "hidden must be a floating"),
    ("not_a_tensor", TypeError, "weight must be a torch.Tensor"),
    ("bias_length", ValueError, "bias must have length 50"),
    ("bias_dtype", TypeError, "bias dtype"),
    ("weight_device", ValueError, "weight is on meta"),
    ("targets_length", ValueError, "targets must have length 8"),
    ("targets_range", ValueError, r"targets must lie in \[0, 50\)"),
    ("empty_vocab", ValueError, "non-empty vocabulary"),
    ("temperature", ValueError, "temperature"),
    ("backend", ValueError, "backend"),
], ids=lambda c: c if isinstance(c, str) and c.islower() else "")
def test_bad_input_is_rejected_with_a_clear_error(case, error, match, device):
    hidden, weight, bias = make_linear(8, 16, 50, torch.float32, device=device)
    targets = torch.randint(0, 50, (8,)).to(device)
    kwargs = dict(bias=bias)
    if case == "hidden_rank":
        hidden = hidden.unsqueeze(0)
    elif case == "weight_rank":
        weight = weight.flatten()
    elif case == "hidden_dim_mismatch":
        weight = weight[:, :15]
    elif case == "dtype_mismatch":
        weight = weight.bfloat16()
    elif case == "integer_hidden":
        hidden = hidden.long()
    elif case == "not_a_tensor":
        weight = weight.tolist()
    elif case == "bias_length":
        kwargs["bias"] = bias[:49]
    elif case == "bias_dtype":
        kwargs["bias"] = bias.double()
    elif case == "weight_device":
        weight = weight.to("meta")
    elif case == "targets_length":
        targets = targets[:7]
    elif case == "targets_range":
        targets[2] = 50
    elif case == "empty_vocab":
        weight, kwargs["bias"] = weight[:0], None
    elif case == "temperature":
        kwargs["temperature"] = 0.0
    elif case == "backend":
        kwargs["backend"] = "cuda"
    with pytest.raises(error, match=match):
        fused_linear_token_logprobs(hidden, weight, targets, **kwargs)


def test_loss_rejects_mismatched_weight_before_any_compute(device):
    batch = random_batch(num_rows=48, vocab=300, device=device)
    hidden, weight, bias = make_linear(48, 40, 300, torch.float32, device=device)
    with pytest.raises(ValueError, match="D = hidden.shape"):
        fused_linear_erpo_loss(hidden, weight.t().contiguous(), batch["targets"], batch["token_kind"],
                               batch["sample_index"], bias=bias, **loss_inputs(batch))
    with pytest.raises(ValueError, match="targets must have length 47"):
        fused_linear_erpo_loss(hidden[:47], weight, batch["targets"], batch["token_kind"], batch["sample_index"],
                               bias=bias, **loss_inputs(batch))
