"""The logits path's loss as one autograd node, where nothing traces (`direct_ops.traced`): the log-prob / entropy
kernel and the objective's kernels in its forward, and in its backward the dlogits kernel alone, which forms
d loss / d logp_t and d loss / d H_t from the objective's gradient coefficients itself (`triton_logits`' backward
kernels with FROM_COEFFICIENTS, through `triton_objective.objective_row_gradients`: the objective's gradient kernel
folded in). The same kernels, operations and values as the two ops in a row (`triton_logits.logp_entropy_op`, then
`triton_objective.objective_op`), which torch.compile and the dispatch modes still get; per fwd+bwd one Triton launch,
one autograd node and three allocations fewer, all host time at a small N (`python -m bench.host_cost`).
"""
from __future__ import annotations

import torch

from .objective import LossOutput
from .triton_logits import _forward_variant, _launch_backward, _launch_forward
from .triton_objective import loss_output, objective_arguments, objective_forward, objective_rows
from .validation import LogitTransform, LossInputs, LossOptions


class _LogitsLoss(torch.autograd.Function):
    """forward(logits [N, V], targets [N] int64 (-100 = ignored), transform, inplace_backward, token_kind,
    sample_index [N], spans [2, S], inputs, options) -> (loss [], logp, entropy [N], query_logp, response_logp [S],
    metrics, counts); only loss is differentiable, in logits."""

    @staticmethod
    def forward(ctx, logits, targets, transform: LogitTransform, inplace_backward: bool, token_kind, sample_index,
                spans, inputs: LossInputs, options: LossOptions):
        logp, entropy, lse = _launch_forward(logits, targets, transform)
        loss, query_logp, response_logp, metrics, counts, coef_logp, coef_entropy, scales = objective_forward(
            logp, entropy, token_kind, sample_index, spans, *objective_arguments(entropy, token_kind, inputs, options))
        ctx.save_for_backward(logits, targets, lse, entropy, token_kind, coef_logp, coef_entropy, scales)
        ctx.transform = transform
        ctx.inplace_backward = inplace_backward
        ctx.variant = _forward_variant[0]  # the backward kernel that goes with the forward that ran
        ctx.mark_non_differentiable(logp, entropy, query_logp, response_logp, metrics, counts)
        ctx.set_materialize_grads(False)
        return loss, logp, entropy, query_logp, response_logp, metrics, counts

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        logits, targets, lse, entropy, token_kind, coef_logp, coef_entropy, scales = ctx.saved_tensors
        if grad_loss is None:
            return (None,) * 9
        grad_logits = logits if ctx.inplace_backward else torch.empty_like(logits)
        _launch_backward(grad_logits, logits, targets, lse, entropy, coef_logp, coef_entropy, ctx.transform,
                         (token_kind, scales, grad_loss.float()), ctx.variant)
        return (grad_logits,) + (None,) * 8


def triton_logits_loss(logits: torch.Tensor, scored_targets: torch.Tensor, token_kind: torch.Tensor,
                       sample_index: torch.Tensor, *, inputs: LossInputs, options: LossOptions,
                       inplace_backward: bool = False, spans: torch.Tensor | None = None) -> LossOutput:
    """The loss on logits [N, V] (`api.erpo_loss`'s, Triton path) as one autograd node (module docstring), for options
    the objective's kernels fuse (`triton_objective.fuses`, the caller checks) and where nothing traces:
    scored_targets [N] int (-100 on rows not scored), token_kind, sample_index [N]; `inputs`, `options` validated;
    spans [2, S] as `triton_objective.triton_objective`'s; inplace_backward writes d logits into `logits`."""
    token_kind, sample_index, spans = objective_rows(token_kind, sample_index, spans, inputs.advantages.shape[0])
    loss, logp, entropy, query_logp, response_logp, metrics, counts = _LogitsLoss.apply(
        logits, scored_targets.long().contiguous(), options.logit_transform, bool(inplace_backward), token_kind,
        sample_index, spans, inputs, options)
    return loss_output(loss, logp, entropy, query_logp, response_logp, metrics, counts, inputs, options)
