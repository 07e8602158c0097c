"""The ERPO loss on [B, T] batches in TRL's layout (prompt then completion columns), with per-token inputs and
outputs completion-aligned [B, C] as TRL and Liger hold them: `padded_erpo_loss`.

The batch becomes packed rows once (`layout.completion_layout`), the loss is the packed `erpo_loss` on every
position (kind 0 where nothing is scored: no selection, no host read) or `fused_linear_erpo_loss` on the scored rows
alone (one host read, which spares the GEMMs the padding), and the per-row results go back to [B, C].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .api import loss_on_logits
from .fused_linear import fused_linear_loss_on_rows
from .layout import completion_layout, mask_check
from .objective import LossMetrics
from .validation import LossInputs, check_tensor, with_option_parameters


@dataclass
class PaddedLossOutput:
    """Result of `padded_erpo_loss`, in the caller's layout.

    loss: 0-dim, differentiable. token_logp, entropy [B, C] fp32: per completion token (0 where completion_mask x
    tool_mask is 0); query_logp, response_logp [B]; metrics: `LossMetrics` (as LossOutput's). All but loss detached.
    """

    loss: torch.Tensor
    token_logp: torch.Tensor
    entropy: torch.Tensor
    query_logp: torch.Tensor
    response_logp: torch.Tensor
    metrics: LossMetrics


def batch_rows(name: str, tensor: torch.Tensor, width: tuple[int, int]) -> torch.Tensor:
    """`tensor` [B, T, K] (logits or hidden) as [B * T, K], after checking its [B, T] against the batch's."""
    check_tensor(name, tensor, ndim=3)
    if tuple(tensor.shape[:2]) != width:
        raise ValueError(f"{name} must have shape [B, T, *] with [B, T] = {width} (prompt then completion columns, "
                         f"every position), got {tuple(tensor.shape)}")
    return tensor.reshape(-1, tensor.shape[2])


@with_option_parameters
def padded_erpo_loss(*, advantages, completion_mask, logits=None, hidden=None, weight=None, bias=None,
                     prompt_ids=None, prompt_mask=None, completion_ids=None, input_ids=None, attention_mask=None,
                     tool_mask=None, ref_query_logp=None, query_weight=None, old_logp=None, ref_logp=None,
                     token_weight=None, rollout_logp=None, backend: str = "auto", validate: bool = True,
                     **options) -> PaddedLossOutput:
    """The ERPO loss (API.md) on B samples in TRL's layout.

    The batch: prompt_ids / prompt_mask [B, P] (left-padded) and completion_ids [B, C] (right-padded), or full
    sequences input_ids / attention_mask [B, T] whose last C columns are the completion; completion_mask [B, C];
    tool_mask [B, C] optional (0 on tool outputs inside the completion: not scored). T = P + C.
    The model's output at every position: logits [B, T, V], or hidden [B, T, D] with the lm_head weight [V, D]
    (+ bias [V]) for the fused-linear path (the [B, T, V] logits never built).
    advantages, ref_query_logp, query_weight [B]; old_logp, ref_logp, token_weight, rollout_logp [B, C]
    completion-aligned (entry j is completion token j; [B, 1] broadcasts). Options as API.md's table; validate as
    `erpo_loss`'s (the value checks of the packed rows) and `completion_layout`'s (the full-sequence mask check):
    False reads nothing on the host on the logits path, True once (the mask check read with the value checks); the
    fused-linear path reads once more, the selection of the scored rows, whose host layout its chunk plan takes.
    Returns a PaddedLossOutput whose `loss` is differentiable with respect to logits (or hidden, weight, bias).
    """
    if (logits is None) == (hidden is None) or (hidden is None) != (weight is None):
        raise ValueError("pass either logits [B, T, V], or hidden [B, T, D] with weight [V, D] (the lm_head)")
    if options.get("qkl_estimator") == "k3-token":
        raise ValueError("qkl_estimator='k3-token' needs reference log-probs on the prompt rows, which the "
                         "completion-aligned ref_logp [B, C] does not hold; use erpo_loss on packed rows")
    # With full sequences and validate, the mask check (`completion_layout`'s) is read with the loss's value checks:
    # one host read for both
    layout = completion_layout(completion_mask=completion_mask, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                               completion_ids=completion_ids, input_ids=input_ids, attention_mask=attention_mask,
                               tool_mask=tool_mask, validate=False)
    checks = [mask_check(layout)] if validate and input_ids is not None else []
    given = dict(old_logp=old_logp, ref_logp=ref_logp, token_weight=token_weight, rollout_logp=rollout_logp)
    width = tuple(layout.input_ids.shape)
    if logits is not None:
        # Every position is a row (kind 0 where nothing is scored): no selection, so no host read and no copy of
        # the logits; the loss skips the rows of kind 0.
        rows = layout
        inputs = LossInputs(advantages=advantages, ref_query_logp=ref_query_logp, query_weight=query_weight,
                            **scattered(layout, given))
        out = loss_on_logits(batch_rows("logits", logits, width), layout.targets, layout.token_kind,
                             layout.sample_index, inputs=inputs, options=options, backend=backend, validate=validate,
                             caller_checks=checks)
    else:
        # The scored rows alone (one host read, whose host layout the chunk plan reuses): GEMMs on the padding rows
        # would cost FLOPs growing with it.
        rows = layout.scored()
        inputs = LossInputs(advantages=advantages, ref_query_logp=ref_query_logp, query_weight=query_weight,
                            **scattered(rows, given))
        out = fused_linear_loss_on_rows(rows.select(batch_rows("hidden", hidden, width)), weight, bias, rows.targets,
                                        rows.token_kind, rows.sample_index, inputs=inputs, options=options,
                                        backend=backend, validate=validate, caller_checks=checks,
                                        host_layout=rows.host_layout)
    return PaddedLossOutput(loss=out.loss, token_logp=rows.gather(out.token_logp), entropy=rows.gather(out.entropy),
                            query_logp=out.query_logp, response_logp=out.response_logp, metrics=out.metrics)


def scattered(rows, given: dict) -> dict:
    """The completion-aligned tensors `given` ({name: [B, C] or None}) on `rows` (a CompletionLayout or its
    ScoredRows)."""
    return {name: None if value is None else rows.scatter(value, name) for name, value in given.items()}
