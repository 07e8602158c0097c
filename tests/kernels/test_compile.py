"""torch.compile: every erpo torch.library op passes `torch.library.opcheck` (schema, fake tensor, autograd
registration, AOT dispatch), and a training step's loss compiled with fullgraph=True (no graph break) gives the
eager loss and gradients, on the torch reference and on the Triton ops. On the `device` fixture's device: CUDA
(Triton compiled) when a GPU is present, else the CPU (Triton's interpreter)."""
import re
from types import SimpleNamespace

import pytest
import torch

from erpo_kernels import erpo_loss, fused_linear_erpo_loss
from erpo_kernels.fused_linear import fused_linear_backward_op, fused_linear_op, host_layout_checks
from erpo_kernels.triton_logits import (
    logp_entropy_backward_inplace_op,
    logp_entropy_backward_op,
    logp_entropy_op,
    triton_token_logprobs,
)
from erpo_kernels.triton_segment import sample_spans_op, segment_sum_op
from erpo_kernels.validation import COMPILED_ROWS_MESSAGE, LogitTransform
from helpers import assert_compiled_equals_eager

pytestmark = pytest.mark.kernels

N, V, D, S = 12, 40, 8, 3
TRANSFORMS = [(1.0, 1.0, None), (0.7, 1.3, 4.0)]  # (temperature, logit_scale, logit_softcap): plain and soft-capped


def layout(device: torch.device) -> SimpleNamespace:
    """The rows of every test here on `device`: token_kind, sample_index [N] (S samples) and targets [N] (-100 on the
    unscored row)."""
    token_kind = torch.tensor([1, 1, 2, 2, 1, 2, 2, 2, 0, 1, 2, 2], device=device)
    targets = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1)).to(device)
    return SimpleNamespace(token_kind=token_kind, targets=targets.masked_fill(token_kind == 0, -100),
                           sample_index=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2], device=device))


@pytest.fixture
def rows(device) -> SimpleNamespace:
    return layout(device)


def per_row(seed: int, device: torch.device):
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_opcheck_triton_logits_ops(transform, rows, device):
    logits = torch.randn(N, V, dtype=torch.float32).to(device).requires_grad_(True)
    torch.library.opcheck(logp_entropy_op, (logits, rows.targets, *transform, False))
    lse, entropy = per_row(2, device).abs() + 3, per_row(3, device).abs()
    backward_args = (rows.targets, lse, entropy, per_row(4, device), per_row(5, device), *transform)
    torch.library.opcheck(logp_entropy_backward_op, (logits.detach(), *backward_args))
    torch.library.opcheck(logp_entropy_backward_inplace_op, (logits.detach().clone(), *backward_args))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_eager_calls_bypass_the_op_and_give_its_values_and_gradients(transform, inplace, rows, device):
    """Outside torch.compile the loss calls the op's implementation through its own autograd Function
    (`direct_ops.DirectOp`, no torch.library layers); under a dispatch mode (here torch.compile's FakeTensorMode
    stands for all) the op itself. Both give bitwise the same log-probs, entropies and d logits."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    logits = torch.randn(N, V).to(device)
    weights = per_row(6, device), per_row(7, device)
    results = []
    for call in ("direct", "op"):
        leaf = logits.clone().requires_grad_(True)
        if call == "direct":
            logp, entropy = triton_token_logprobs(leaf, rows.targets, LogitTransform(*transform), inplace)
            assert type(logp.grad_fn).__name__ == "logp_entropy_functionBackward"
        else:
            logp, entropy, _ = logp_entropy_op(leaf, rows.targets, *transform, inplace)
            assert "erpo_triton_logp_entropy" in type(logp.grad_fn).__name__
        (weights[0] * logp + weights[1] * entropy).sum().backward()
        results.append((logp, entropy, leaf if inplace else leaf.grad))
    for direct, op in zip(*results):
        assert torch.equal(direct.detach(), op.detach())
    with FakeTensorMode() as fake:
        fake_logits = fake.from_tensor(logits)
        logp, _ = triton_token_logprobs(fake_logits, fake.from_tensor(rows.targets))
        assert logp.shape == (N,)  # the op's fake implementation: the kernels never saw a fake tensor


def test_opcheck_triton_segment_sum(rows, device):
    values = torch.randn(N).to(device).requires_grad_(True)
    spans = sample_spans_op(rows.sample_index, S)
    torch.library.opcheck(sample_spans_op, (rows.sample_index, S))
    torch.library.opcheck(sample_spans_op, (rows.sample_index, S, rows.token_kind))
    # with the targets: the spans then the scored targets, [2 S + N] (the logits path's validate=False)
    torch.library.opcheck(sample_spans_op, (rows.sample_index, S, rows.token_kind, rows.targets))
    torch.library.opcheck(segment_sum_op, (values, rows.sample_index, spans))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_fused_linear_ops(kernels, with_bias, rows, device):
    hidden = torch.randn(N, D).to(device).requires_grad_(True)
    weight = torch.randn(V, D).to(device).requires_grad_(True)
    bias = torch.randn(V).to(device).requires_grad_(True) if with_bias else None
    transform = TRANSFORMS[1]
    torch.library.opcheck(fused_linear_op, (hidden, weight, bias, rows.targets, *transform, kernels))
    lse, entropy = per_row(2, device).abs() + 3, per_row(3, device).abs()
    for needs in [(True, True, with_bias), (False, True, False), (True, False, False)]:
        torch.library.opcheck(fused_linear_backward_op, (
            hidden.detach(), weight.detach(), None if bias is None else bias.detach(), rows.targets, lse, entropy,
            per_row(4, device), per_row(5, device), *transform, kernels, *needs))


class TinyPolicy(torch.nn.Module):
    """features [N, 6] -> hidden [N, D] -> logits [N, V] (lm_head with a bias)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, D)
        self.lm_head = torch.nn.Linear(D, V)


def loss_step(model, features, rows, path: str, backend: str, **fused_linear_options):
    """The loss of one training step on `path` ("logits", "logits-inplace": inplace_backward, "logits-unchecked":
    validate=False, "fused-linear", which takes `fused_linear_options`: host_layout, validate)."""
    device = features.device
    inputs = dict(advantages=torch.tensor([1.0, -0.5, 0.25], device=device),
                  ref_query_logp=torch.tensor([-4.0, -2.5, -3.0], device=device),
                  qkl_coef=0.1, logit_softcap=4.0, temperature=0.9, backend=backend)
    hidden = torch.tanh(model.body(features))
    if path == "fused-linear":
        out = fused_linear_erpo_loss(hidden, model.lm_head.weight, rows.targets, rows.token_kind, rows.sample_index,
                                     bias=model.lm_head.bias, **inputs, **fused_linear_options)
    else:
        out = erpo_loss(model.lm_head(hidden), rows.targets, rows.token_kind, rows.sample_index,
                        inplace_backward=path == "logits-inplace", validate=path != "logits-unchecked", **inputs)
    # the mapping traces whole, its absent metrics too (no ref_logp, rollout_logp, off-policy mask, vespo)
    assert "policy_kl" not in out.metrics and out.metrics.get("vespo_phi_mean") is None and len(out.metrics) == 10
    return out.loss, out.metrics["entropy"]


def gradients_of(step, model, features):
    model.zero_grad()
    loss, entropy = step(model, features)
    loss.backward()
    return loss.detach(), entropy, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("path", ["logits", "logits-inplace", "logits-unchecked", "fused-linear"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_step_equals_eager(path, backend, rows, device):
    model, features = TinyPolicy().to(device), torch.randn(N, 6, generator=torch.Generator().manual_seed(7)).to(device)

    def step(model, features):
        return loss_step(model, features, rows, path, backend)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break is an error
    eager_loss, eager_entropy, eager_grads = gradients_of(step, model, features)
    loss, entropy, grads = gradients_of(compiled, model, features)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, eager_entropy, rtol=1e-6, atol=1e-6)
    for grad, eager_grad in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-6)
    assert any(grad.abs().sum() > 0 for grad in grads)


def host_layout_of(rows) -> torch.Tensor:
    """[2, N] int64 host copy of the rows' token_kind and sample_index (`fused_linear_erpo_loss`'s host_layout)."""
    return torch.stack((rows.token_kind, rows.sample_index)).long().cpu()


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_fused_linear_loss_plans_on_the_host_layout(backend, validate, rows, device, monkeypatch):
    """fused_linear_erpo_loss(host_layout=...) under torch.compile(fullgraph=True): the host layout is a tensor
    argument of the op, so the compiled step plans its chunks on it as the eager one does (the plan's read of the
    rows, `read_later`, is not called; once a step without it) and gives the eager loss and gradients; with
    validate=True its check against the rows (an upload and a comparison) is traced into the graph."""
    import erpo_kernels.fused_linear_loss as fused_linear_loss

    reads = []
    read_later = fused_linear_loss.read_later
    monkeypatch.setattr(fused_linear_loss, "read_later", lambda value: reads.append(value) or read_later(value))
    model, features = TinyPolicy().to(device), torch.randn(N, 6, generator=torch.Generator().manual_seed(7)).to(device)
    results = {}
    for host_layout in (None, host_layout_of(rows)):
        def step(model, features):
            return loss_step(model, features, rows, "fused-linear", backend, host_layout=host_layout,
                             validate=validate)

        torch._dynamo.reset()
        eager = gradients_of(step, model, features)
        reads.clear()
        results[host_layout is None] = gradients_of(torch.compile(step, fullgraph=True, backend="aot_eager"), model,
                                                    features), len(reads)
        for value, eager_value in zip(results[host_layout is None][0], eager):
            torch.testing.assert_close(value, eager_value, rtol=1e-5, atol=1e-6)
    (given, reads_given), (without, reads_without) = results[False], results[True]
    assert (reads_given, reads_without) == (0, 1)
    torch.testing.assert_close(given, without, rtol=0, atol=0)



def test_the_host_layout_check_compiles_for_cuda_without_pinning():
    """On CUDA the eager check pins host_layout before its upload (`common.host_to_device`), and FakeTensor cannot
    pin (`aten._pin_memory`: not implemented): a compiled step with a host_layout on a GPU failed to trace (the H100
    run of 2026-11-26, both backends). Checked on any machine, GPU or not: the check of fake CUDA rows
    (FakeTensorMode makes CUDA tensors without a GPU) traced by torch.compile(fullgraph=True) into a graph that is
    recorded and run on the fake tensors: one upload of the host layout to CUDA, non_blocking, nothing pinned, and
    the rows that disagree as a CUDA mask."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def recorded(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    def disagreeing_rows(host_layout, token_kind, sample_index):
        (bad, _message), = host_layout_checks(host_layout, token_kind, sample_index)
        return bad

    torch._dynamo.reset()
    with FakeTensorMode(allow_non_fake_inputs=True):
        host_layout = torch.empty(2, N, dtype=torch.int64, device="cpu")
        token_kind, sample_index = torch.empty(2, N, dtype=torch.int64, device="cuda").unbind()
        bad = torch.compile(disagreeing_rows, fullgraph=True, backend=recorded)(host_layout, token_kind, sample_index)
    assert bad.device.type == "cuda" and bad.dtype == torch.bool and bad.shape == (N,)
    (graph,) = graphs
    uploads = [node for node in graph.graph.nodes if node.target == "to"]
    assert len(uploads) == 1 and uploads[0].args[1].type == "cuda" and uploads[0].kwargs == {"non_blocking": True}
    assert "pin_memory" not in graph.code

OPTION_SETS = {  # options whose code paths differ (each traced whole: fullgraph)
    "gspo-seq-mean": dict(ratio_level="sequence", loss_agg="seq-mean-token-mean"),
    "vespo": dict(pg_objective="vespo"),
    "cispo-entropy-filter": dict(pg_objective="cispo", top_entropy_quantile=0.5, entropy_coef=0.01),
    "k3-token-policy-kl": dict(qkl_estimator="k3-token", policy_kl_coef=0.05, policy_kl_bias_correction=True,
                               dual_clip=3.0, off_policy_mask_threshold=0.5, entropy_agg="token-mean",
                               entropy_coef=0.01),
}


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_compiled_loss_with_options_equals_eager(options, rows, device):
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(3)).to(device).requires_grad_(True)
    tensors = dict(advantages=torch.tensor([1.0, -0.5, 0.25], device=device),
                   ref_query_logp=torch.tensor([-4.0, -2.5, -3.0], device=device),
                   old_logp=-per_row(4, device).abs(), ref_logp=-per_row(5, device).abs(),
                   rollout_logp=-per_row(6, device).abs(), token_weight=per_row(7, device).abs(),
                   query_weight=torch.tensor([0.5, 1.0, 1.5], device=device))

    def loss(logits):
        return erpo_loss(logits, rows.targets, rows.token_kind, rows.sample_index, backend="torch", **tensors,
                         **options).loss

    assert_compiled_equals_eager(loss, logits, grad_rtol=1e-5)


def test_compiled_step_with_inductor_equals_eager(rows, device):
    """The fused-linear torch path through Inductor (C++ codegen on CPU, Triton codegen on CUDA)."""
    model, features = TinyPolicy().to(device), torch.randn(N, 6, generator=torch.Generator().manual_seed(7)).to(device)

    def step(model, features):
        return loss_step(model, features, rows, "fused-linear", "torch")

    torch._dynamo.reset()
    eager_loss, _, eager_grads = gradients_of(step, model, features)
    loss, _, grads = gradients_of(torch.compile(step, fullgraph=True, backend="inductor"), model, features)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for grad, eager_grad in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-6)


def test_compiled_loss_rejects_bad_rows():
    """Under torch.compile the row checks are one device-side assert (no host sync): it still fires. On the CPU
    only: a failed device-side assert on CUDA leaves the process's CUDA context unusable for every later test."""
    rows = layout(torch.device("cpu"))
    logits = torch.randn(N, V, device="cpu")
    bad_kind = rows.token_kind.clone()
    bad_kind[3] = 5

    def loss(token_kind):
        return erpo_loss(logits, rows.targets.clamp_min(0), token_kind, rows.sample_index,
                         advantages=torch.ones(S, device="cpu"), qkl_coef=0.0, backend="torch").loss

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    assert torch.isfinite(compiled(rows.token_kind))
    with pytest.raises(RuntimeError, match=re.escape(COMPILED_ROWS_MESSAGE)):
        compiled(bad_kind)


def test_compiled_loss_rejects_a_host_layout_that_disagrees_with_the_rows():
    """Under torch.compile with validate=True a host_layout whose token_kind differs from the rows' fails the one
    device-side assert of the row checks, whose message names host_layout. On the CPU only, as above."""
    rows = layout(torch.device("cpu"))
    stale = host_layout_of(rows)
    stale[0, 3] = 1  # row 3: a response row the layout calls a query row
    model, features = TinyPolicy(), torch.randn(N, 6, generator=torch.Generator().manual_seed(7), device="cpu")

    def loss(host_layout):
        return loss_step(model, features, rows, "fused-linear", "torch", host_layout=host_layout)[0]

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    assert torch.isfinite(compiled(host_layout_of(rows)))
    with pytest.raises(RuntimeError, match=re.escape(COMPILED_ROWS_MESSAGE)):
        compiled(stale)
    assert "host_layout" in COMPILED_ROWS_MESSAGE
