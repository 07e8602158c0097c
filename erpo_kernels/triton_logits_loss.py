"""The logits path's loss as one autograd node, where nothing traces (`direct_ops.traced`): the log-prob / entropy
kernel and the objective's sample kernel in its forward, whose last program also runs the objective's finish
(`triton_objective._objective_sample_finish_kernel`), and in its backward the dlogits kernel alone, which forms d loss /
d logp_t and d loss / d H_t from the objective's gradient coefficients itself (`triton_logits`' node backward kernels,
through `triton_objective.objective_row_gradients`: the objective's gradient kernel folded in). The
same operations and values as the two ops in a row (`triton_logits.logp_entropy_op`, then
`triton_objective.objective_op`), which torch.compile and the dispatch modes still get (bit for bit under the
interpreter; on a GPU the objective's kernels lay their sums out alike, what bit-equality takes there:
`triton_objective`'s docstring); per fwd+bwd two Triton launches and one autograd node fewer, all host time at a small N
(`python -m bench.host_cost`). The forward's fp32 tensors are regions of one allocation
(`triton_objective.NodeWorkspace`; the counts and the finish's ticket counter beside it, in the row checks' or the spans
kernel's buffer, which zeroes the ticket: no fill launch), which the sample kernel and the backward's dlogits kernel
find from one pointer. What depends only on the options and on which inputs are given (the objective's settings,
kernel arguments, metric slots and the logit transform) comes from one `triton_objective.ObjectivePlan` per distinct
(options, given inputs), the sample kernel's float settings from one device vector per distinct values
(`triton_objective.node_scalars`); the metrics record is made on its first read (`triton_objective.SlotMetrics`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .objective import LossOutput
from .triton_logits import _forward_variant, _launch_forward, _launch_node_backward, overwritten
from .triton_objective import (
    NodeWorkspace,
    ObjectivePlan,
    as_fp32,
    launch_node_objective,
    loss_output_in_slots,
    objective_arguments,
    objective_plan,
    objective_rows,
)
from .validation import LossInputs, LossOptions


class _NodeCall(NamedTuple):
    """What `_LogitsLoss` takes besides the logits, as one argument: autograd's `apply` handles each argument it is
    given on the host (about 1 us each in `python -m bench.host_cost`), and none of these takes a gradient.
    targets [N] int64 (-100 = ignored), token_kind, sample_index [N], spans [2, S]; counts: the objective's counts
    [4] int64 with the ticket zeroed, or None (`triton_objective.launch_node_objective`); `outputs`: the list the
    outputs that carry no gradient are appended to."""

    targets: torch.Tensor
    inplace_backward: bool
    token_kind: torch.Tensor
    sample_index: torch.Tensor
    spans: torch.Tensor
    counts: torch.Tensor | None
    inputs: LossInputs
    options: LossOptions
    plan: ObjectivePlan
    outputs: list


class _LogitsLoss(torch.autograd.Function):
    """forward(logits [N, V], call: _NodeCall) -> loss [], differentiable in logits; the outputs that are not (logp,
    entropy [N], query_logp, response_logp [S], metrics, counts) are appended to the list `call.outputs` rather than
    returned: autograd then wraps one output, not seven (`python -m bench.host_cost`)."""

    @staticmethod
    def forward(ctx, logits, call: _NodeCall):
        inputs, plan = call.inputs, call.plan
        workspace = NodeWorkspace.empty(logits.shape[0], inputs.advantages.shape[0], logits.device)
        _launch_forward(logits, call.targets, plan.logit_transform,
                        out=(workspace.logp, workspace.entropy, workspace.lse))
        *loss_tensors, num_items, num_seqs, entropy_threshold, settings = objective_arguments(
            workspace.entropy, call.token_kind, inputs, call.options, plan.settings)
        counts = launch_node_objective(workspace, call.token_kind, call.sample_index, call.spans, loss_tensors,
                                       num_items, num_seqs, entropy_threshold, settings, plan.arguments, call.counts)
        ctx.save_for_backward(logits, call.targets, call.token_kind, workspace.whole, workspace.scales)
        ctx.transform = plan.logit_transform
        ctx.inplace_backward = call.inplace_backward
        ctx.variant = _forward_variant[0]  # the backward kernel that goes with the forward that ran
        ctx.set_materialize_grads(False)
        call.outputs.extend((workspace.logp, workspace.entropy, workspace.query_logp, workspace.response_logp,
                             workspace.metrics, counts))
        return workspace.loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, token_kind, workspace, scales = ctx.saved_tensors
        if grad_loss is None:
            return None, None
        grad_logits = logits if ctx.inplace_backward else torch.empty_like(logits)
        _launch_node_backward(grad_logits, logits, targets, workspace, token_kind, scales, as_fp32(grad_loss),
                              ctx.transform, ctx.variant)
        return overwritten(grad_logits) if ctx.inplace_backward else grad_logits, None


def triton_logits_loss(logits: torch.Tensor, scored_targets: torch.Tensor, token_kind: torch.Tensor,
                       sample_index: torch.Tensor, *, inputs: LossInputs, options: LossOptions,
                       inplace_backward: bool = False, spans: torch.Tensor | None = None,
                       counts: torch.Tensor | None = None) -> LossOutput:
    """The loss on logits [N, V] (`api.erpo_loss`'s, Triton path) as one autograd node (module docstring), for options
    the objective's kernels fuse (`triton_objective.fuses`, the caller checks) and where nothing traces:
    scored_targets [N] int (-100 on rows not scored), token_kind, sample_index [N]; `inputs`, `options` validated;
    spans [2, S] as `triton_objective.triton_objective`'s; counts [4] int64 with their ticket counter zeroed, from
    the kernel that formed the spans (`triton_row_checks.RowChecksWithSpans.counts`), or None (a fill here);
    inplace_backward writes d logits into `logits`."""
    token_kind, sample_index, spans = objective_rows(token_kind, sample_index, spans, inputs.advantages.shape[0])
    plan = objective_plan(options, inputs, has_entropy=True)
    outputs = []
    # the kernels that form the scored targets write int64: no `long()` dispatched for nothing (a no-op aten::to)
    targets = scored_targets if scored_targets.dtype == torch.int64 else scored_targets.long()
    loss = _LogitsLoss.apply(logits, _NodeCall(targets.contiguous(), bool(inplace_backward), token_kind,
                                               sample_index, spans, counts, inputs, options, plan, outputs))
    logp, entropy, query_logp, response_logp, metrics, counts = outputs
    return loss_output_in_slots(loss, logp, entropy, query_logp, response_logp, metrics, counts, plan.metric_slots)
