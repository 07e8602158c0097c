"""`nn.Module` wrappers around the functional API, for trainers that configure a loss object once: `ERPOLoss`
(logits) and `FusedLinearERPOLoss` (hidden states x lm_head, in Liger's `LigerFusedLinearGRPOLoss` call order)."""
from __future__ import annotations

import torch

from .api import erpo_loss
from .fused_linear import fused_linear_token_logprobs
from .objective import LossOutput
from .padded import PaddedLossOutput, padded_erpo_loss
from .validation import (
    IGNORE_INDEX,
    LossOptions,
    check_backend,
    check_tensor,
    check_validate,
    with_option_parameters,
)


def options_repr(backend: str, options: dict) -> str:
    """A loss module's `extra_repr`: its backend and the options it was built with."""
    return ", ".join(f"{k}={v!r}" for k, v in {"backend": backend, **options}.items())


class ERPOLoss(torch.nn.Module):
    """`ERPOLoss(**options, backend="auto")(logits, targets, token_kind, sample_index, advantages=..., ...)`
    is `erpo_loss` with the options (and `validate`) fixed at construction (checked there)."""

    @with_option_parameters
    def __init__(self, *, backend: str = "auto", inplace_backward: bool = False, validate: bool = True, **options):
        super().__init__()
        check_backend(backend)
        check_validate(validate)
        LossOptions.from_kwargs(options)
        self.backend = backend
        self.inplace_backward = inplace_backward
        self.validate = validate
        self.options = options

    def forward(self, logits, targets, token_kind, sample_index, **tensors) -> LossOutput:
        return erpo_loss(logits, targets, token_kind, sample_index, backend=self.backend,
                         inplace_backward=self.inplace_backward, validate=self.validate, **tensors, **self.options)

    def extra_repr(self) -> str:
        return options_repr(self.backend, self.options)


class FusedLinearERPOLoss(torch.nn.Module):
    """The fused-linear ERPO loss as a module, called in `LigerFusedLinearGRPOLoss.forward`'s positional order
    (docs/API.md maps Liger's arguments onto erpo's): `FusedLinearERPOLoss(**options, backend="auto")`, then
    `loss_fn(_input, lin_weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
    old_per_token_logps, ref_input, ref_weight, ref_bias, prompt_ids=..., prompt_mask=..., ref_query_logp=...)`.
    Returns a PaddedLossOutput (`padded_erpo_loss`): the loss and [B, C] per-token outputs."""

    @with_option_parameters
    def __init__(self, *, backend: str = "auto", validate: bool = True, **options):
        super().__init__()
        check_backend(backend)
        check_validate(validate)
        self.resolved = LossOptions.from_kwargs(options)
        self.backend = backend
        self.validate = validate
        self.options = options

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                *, prompt_ids=None, prompt_mask=None, tool_mask=None, ref_query_logp=None, query_weight=None,
                token_weight=None, rollout_logp=None) -> PaddedLossOutput:
        """selected_token_ids / attention_mask [B, C]: the completion ids and mask; advantages [B]; lin_weight [V, D]
        and bias [V]: the lm_head; ref_per_token_logps, old_per_token_logps [B, C] completion-aligned.
        _input: with prompt_ids / prompt_mask [B, P] (needed for the Query-KL, qkl_coef != 0), the final hidden
        state at every position [B, P + C, D]; without them, Liger's [B, C, D] (position j predicts completion
        token j). ref_input (same layout as _input), ref_weight, ref_bias: the reference model's, used for the
        Policy-KL when ref_per_token_logps is None. ref_query_logp, query_weight [B]; tool_mask, token_weight,
        rollout_logp [B, C]: as `padded_erpo_loss`."""
        check_tensor("selected_token_ids", selected_token_ids, ndim=2)
        check_tensor("_input", _input, ndim=3)
        completion = selected_token_ids.shape[1]
        if ref_input is not None and (not isinstance(ref_input, torch.Tensor) or ref_input.shape != _input.shape):
            raise ValueError(f"ref_input must have _input's shape {tuple(_input.shape)} (the same positions), got "
                             f"{getattr(ref_input, 'shape', type(ref_input).__name__)}")
        if prompt_ids is None:
            if self.resolved.qkl_coef != 0:
                raise ValueError("the Query-KL (qkl_coef != 0) needs the prompt: pass prompt_ids, prompt_mask and "
                                 "_input as the final hidden state at every position [B, P + C, D], or qkl_coef=0")
            # Liger's layout as TRL's: a one-token prompt, which nothing predicts (no query rows), and one more
            # hidden column at the end (the last position, which predicts nothing): [B, 1 + C, D]
            first = torch.ones_like(selected_token_ids[:, :1])
            prompt_ids, prompt_mask = first, first
            _input = torch.cat([_input, _input[:, :1]], dim=1)
            ref_input = None if ref_input is None else torch.cat([ref_input, ref_input[:, :1]], dim=1)
        if ref_per_token_logps is None and ref_input is not None and self.resolved.policy_kl_coef != 0:
            ref_per_token_logps = self.reference_logprobs(ref_input[:, -completion - 1:-1], ref_weight, ref_bias,
                                                          selected_token_ids, attention_mask)
        return padded_erpo_loss(
            hidden=_input, weight=lin_weight, bias=bias, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            completion_ids=selected_token_ids, completion_mask=attention_mask, tool_mask=tool_mask,
            advantages=advantages, ref_query_logp=ref_query_logp, query_weight=query_weight,
            old_logp=old_per_token_logps, ref_logp=ref_per_token_logps, token_weight=token_weight,
            rollout_logp=rollout_logp, backend=self.backend, validate=self.validate, **self.options)

    def reference_logprobs(self, ref_hidden, ref_weight, ref_bias, completion_ids, completion_mask):
        """The reference model's log-probs [B, C] of the completion tokens (0 where completion_mask is 0) from its
        hidden states [B, C, D] predicting them, under this loss's logit transform; no gradient."""
        targets = completion_ids.masked_fill(completion_mask == 0, IGNORE_INDEX).reshape(-1)
        transform = self.resolved.logit_transform
        with torch.no_grad():
            logp = fused_linear_token_logprobs(
                ref_hidden.reshape(-1, ref_hidden.shape[-1]), ref_weight, targets, bias=ref_bias,
                temperature=transform.temperature, logit_scale=transform.logit_scale,
                logit_softcap=transform.logit_softcap, backend=self.backend)
        return logp.reshape(completion_ids.shape)

    def extra_repr(self) -> str:
        return options_repr(self.backend, self.options)
