"""torch.compile: every erpo torch.library op passes `torch.library.opcheck` (schema, fake tensor, autograd
registration, AOT dispatch), and a training step's loss compiled with fullgraph=True (no graph break) gives the
eager loss and gradients, on the torch reference and on the Triton ops (the interpreter on CPU)."""
import re

import pytest
import torch

from erpo_kernels import erpo_loss, fused_linear_erpo_loss
from erpo_kernels.fused_linear import fused_linear_backward_op, fused_linear_op
from erpo_kernels.triton_logits import (
    logp_entropy_backward_inplace_op,
    logp_entropy_backward_op,
    logp_entropy_op,
)
from erpo_kernels.triton_segment import segment_sum_op
from erpo_kernels.validation import COMPILED_ROWS_MESSAGE

pytestmark = pytest.mark.kernels

N, V, D, S = 12, 40, 8, 3
TOKEN_KIND = torch.tensor([1, 1, 2, 2, 1, 2, 2, 2, 0, 1, 2, 2])
SAMPLE_INDEX = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2])
TRANSFORMS = [(1.0, 1.0, None), (0.7, 1.3, 4.0)]  # (temperature, logit_scale, logit_softcap): plain and soft-capped
TARGETS = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1)).masked_fill(TOKEN_KIND == 0, -100)


def per_row(seed: int):
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_opcheck_triton_logits_ops(transform):
    logits = torch.randn(N, V, dtype=torch.float32, requires_grad=True)
    torch.library.opcheck(logp_entropy_op, (logits, TARGETS, *transform, False))
    lse, entropy = per_row(2).abs() + 3, per_row(3).abs()
    backward_args = (TARGETS, lse, entropy, per_row(4), per_row(5), *transform)
    torch.library.opcheck(logp_entropy_backward_op, (logits.detach(), *backward_args))
    torch.library.opcheck(logp_entropy_backward_inplace_op, (logits.detach().clone(), *backward_args))


def test_opcheck_triton_segment_sum():
    values = torch.randn(N, requires_grad=True)
    order = torch.sort(SAMPLE_INDEX, stable=True).indices
    starts = torch.searchsorted(SAMPLE_INDEX[order], torch.arange(S + 1))
    torch.library.opcheck(segment_sum_op, (values, SAMPLE_INDEX, order, starts))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_fused_linear_ops(kernels, with_bias):
    hidden = torch.randn(N, D, requires_grad=True)
    weight = torch.randn(V, D, requires_grad=True)
    bias = torch.randn(V, requires_grad=True) if with_bias else None
    transform = TRANSFORMS[1]
    torch.library.opcheck(fused_linear_op, (hidden, weight, bias, TARGETS, *transform, kernels))
    lse, entropy = per_row(2).abs() + 3, per_row(3).abs()
    for needs in [(True, True, with_bias), (False, True, False), (True, False, False)]:
        torch.library.opcheck(fused_linear_backward_op, (
            hidden.detach(), weight.detach(), None if bias is None else bias.detach(), TARGETS, lse, entropy,
            per_row(4), per_row(5), *transform, kernels, *needs))


class TinyPolicy(torch.nn.Module):
    """features [N, 6] -> hidden [N, D] -> logits [N, V] (lm_head with a bias)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, D)
        self.lm_head = torch.nn.Linear(D, V)


def loss_step(model, features, path: str, backend: str):
    """The loss of one training step on `path` ("logits", "logits-inplace": inplace_backward, "fused-linear")."""
    inputs = dict(advantages=torch.tensor([1.0, -0.5, 0.25]), ref_query_logp=torch.tensor([-4.0, -2.5, -3.0]),
                  qkl_coef=0.1, logit_softcap=4.0, temperature=0.9, backend=backend)
    hidden = torch.tanh(model.body(features))
    if path == "fused-linear":
        out = fused_linear_erpo_loss(hidden, model.lm_head.weight, TARGETS, TOKEN_KIND, SAMPLE_INDEX,
                                     bias=model.lm_head.bias, **inputs)
    else:
        out = erpo_loss(model.lm_head(hidden), TARGETS, TOKEN_KIND, SAMPLE_INDEX,
                        inplace_backward=path == "logits-inplace", **inputs)
    return out.loss, out.metrics["entropy"]


def gradients_of(step, model, features):
    model.zero_grad()
    loss, entropy = step(model, features)
    loss.backward()
    return loss.detach(), entropy, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("path", ["logits", "logits-inplace", "fused-linear"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_step_equals_eager(path, backend):
    model, features = TinyPolicy(), torch.randn(N, 6, generator=torch.Generator().manual_seed(7))

    def step(model, features):
        return loss_step(model, features, path, backend)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break is an error
    eager_loss, eager_entropy, eager_grads = gradients_of(step, model, features)
    loss, entropy, grads = gradients_of(compiled, model, features)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, eager_entropy, rtol=1e-6, atol=1e-6)
    for grad, eager_grad in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-6)
    assert any(grad.abs().sum() > 0 for grad in grads)


OPTION_SETS = {  # options whose code paths differ (each traced whole: fullgraph)
    "gspo-seq-mean": dict(ratio_level="sequence", loss_agg="seq-mean-token-mean"),
    "vespo": dict(pg_objective="vespo"),
    "cispo-entropy-filter": dict(pg_objective="cispo", top_entropy_quantile=0.5, entropy_coef=0.01),
    "k3-token-policy-kl": dict(qkl_estimator="k3-token", policy_kl_coef=0.05, policy_kl_bias_correction=True,
                               dual_clip=3.0, off_policy_mask_threshold=0.5, entropy_agg="token-mean",
                               entropy_coef=0.01),
}


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_compiled_loss_with_options_equals_eager(options):
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(3), requires_grad=True)
    tensors = dict(advantages=torch.tensor([1.0, -0.5, 0.25]), ref_query_logp=torch.tensor([-4.0, -2.5, -3.0]),
                   old_logp=-per_row(4).abs(), ref_logp=-per_row(5).abs(), rollout_logp=-per_row(6).abs(),
                   token_weight=per_row(7).abs(), query_weight=torch.tensor([0.5, 1.0, 1.5]))

    def loss(logits):
        return erpo_loss(logits, TARGETS, TOKEN_KIND, SAMPLE_INDEX, backend="torch", **tensors, **options).loss

    torch._dynamo.reset()
    eager = loss(logits)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(logits)
    (grad,) = torch.autograd.grad(compiled, logits)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-7)


def test_compiled_step_with_inductor_equals_eager():
    """The fused-linear torch path through Inductor (C++ codegen on CPU)."""
    model, features = TinyPolicy(), torch.randn(N, 6, generator=torch.Generator().manual_seed(7))

    def step(model, features):
        return loss_step(model, features, "fused-linear", "torch")

    torch._dynamo.reset()
    eager_loss, _, eager_grads = gradients_of(step, model, features)
    loss, _, grads = gradients_of(torch.compile(step, fullgraph=True, backend="inductor"), model, features)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for grad, eager_grad in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-6)


def test_compiled_loss_rejects_bad_rows():
    """Under torch.compile the row checks are one device-side assert (no host sync): it still fires."""
    logits = torch.randn(N, V)
    bad_kind = TOKEN_KIND.clone()
    bad_kind[3] = 5

    def loss(token_kind):
        return erpo_loss(logits, TARGETS.clamp_min(0), token_kind, SAMPLE_INDEX,
                         advantages=torch.ones(S), qkl_coef=0.0, backend="torch").loss

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    assert torch.isfinite(compiled(TOKEN_KIND))
    with pytest.raises(RuntimeError, match=re.escape(COMPILED_ROWS_MESSAGE)):
        compiled(bad_kind)
