"""How ERPOTrainer scores a micro-batch, chosen once per `_compute_loss`: `FusedLinearScorer` (hidden states x the
lm_head in the kernels, with the model's logit transform, on the scored rows alone; the [R, V] logits never built)
or `LogitsScorer` (the model's own logits, already transformed, on every position). Both run the forward at
construction and give, inside `head()`, the detached log-probs of their rows (`logprobs`) and the ERPO loss (`loss`)
of the same forward. Their `batch` is `completion_rows`' (layout.py), for each path."""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from erpo.sequences import PackedBatch, final_hidden_and_output, on_whole_lm_head
from erpo_kernels import (
    CompletionLayout,
    erpo_loss,
    fused_linear_erpo_loss,
    fused_linear_token_logprobs,
    token_logprobs,
)
from erpo_kernels.lm_head import is_dtensor
from erpo_kernels.zero3 import find_lm_head


class LogitsScorer:
    """The model's logits [B * T, V] of every position of `batch` (a CompletionLayout: kind 0 where nothing is
    scored), as the forward returns them: no selection of the scored rows, so no host read and no [R, V] copy (the
    loss skips the rows of kind 0). The forward runs under `autocast` (a context manager factory); `output`: the
    model's whole output, for the MoE aux_loss (`release_output()` drops it)."""

    def __init__(self, model, batch: CompletionLayout, *, temperature: float, autocast, logit_options: dict,
                 **forward_kwargs):
        self.batch, self.temperature = batch, temperature
        with autocast():
            self.output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                                **forward_kwargs)
            self.logits = self.output.logits.reshape(-1, self.output.logits.shape[-1])

    def release_output(self) -> None:
        self.output = None

    @contextlib.contextmanager
    def head(self):
        yield self

    def logprobs(self, kind: int | None = None) -> torch.Tensor:
        """Detached log-probs [B * T] fp32 of the rows, as the loss scores them (0 on rows of kind 0); with `kind`,
        of the rows of that kind only (0 elsewhere). Every row is scored either way: the logits exist already, and a
        selection would cost a host read and a copy."""
        logp = token_logprobs(self.logits.detach(), self.batch.targets, temperature=self.temperature)
        return logp if kind is None else torch.where(self.batch.token_kind == kind, logp, 0.0)

    def loss(self, **inputs):
        """`erpo_loss` on the logits; `inputs`: the loss's per-sample and per-row tensors and options."""
        b = self.batch
        return erpo_loss(self.logits, b.targets, b.token_kind, b.sample_index, **inputs)


class FusedLinearScorer:
    """The final hidden states [R, D] of the scored rows (the forward under `autocast`) and, inside `head()`, the whole
    lm_head (`on_whole_lm_head`: under DeepSpeed ZeRO-3 each scoring runs as the head's own forward, gathered for it
    and again for TRL's backward after the loss has returned) with the model's logit transform `logit_options`;
    `workspace_bytes`: the loss's row-chunk budget (bytes)."""

    def __init__(self, model, batch: PackedBatch, *, temperature: float, autocast, logit_options: dict,
                 workspace_bytes: int, **forward_kwargs):
        self.model, self.batch, self.temperature, self.logit_options = model, batch, temperature, logit_options
        self.workspace_bytes = workspace_bytes
        with autocast():
            self.hidden, self.output = final_hidden_and_output(model, batch, **forward_kwargs)
        # whole_lm_head would reshard an FSDP2 head at the end of its block, before TRL's backward
        head = find_lm_head(model)
        if is_dtensor(head.weight):
            raise ValueError("fused_linear=True under FSDP2 needs the lm_head unsharded after the forward (TRL "
                             "runs the backward after the loss returns): keep it in the root's or accelerate's "
                             "tail fully_shard unit (reshard_after_forward=False), or set fused_linear=False")
        self.hidden = self.hidden.to(head.weight.dtype)   # a ZeRO-3 shard keeps its parameter's dtype
        self.on_head = None

    def release_output(self) -> None:
        self.output = None

    @contextlib.contextmanager
    def head(self):
        with on_whole_lm_head(self.model) as run:
            self.on_head = run
            try:
                yield self
            finally:
                self.on_head = None

    def logprobs(self, kind: int | None = None) -> torch.Tensor:
        """Detached log-probs [R] fp32 of the scored rows, as the loss scores them; with `kind`, of the rows of that
        kind only (0 elsewhere), whose GEMMs alone run. Their number comes from the batch's host layout
        (`completion_rows`' read; without one, token_kind is read here), so the device finds them with no host read
        (`nonzero_static`, where a boolean index reads the count)."""
        def scored_logp(hidden, targets):
            return self.on_head(lambda weight, bias, rows, rows_targets: fused_linear_token_logprobs(
                rows, weight, rows_targets, bias=bias, temperature=self.temperature, **self.logit_options),
                hidden, targets)

        if kind is None:
            return scored_logp(self.hidden.detach(), self.batch.targets)
        host_layout = self.batch.host_layout
        host_kind = (self.batch.token_kind.cpu() if host_layout is None else host_layout[0]).numpy()
        index = torch.nonzero_static(self.batch.token_kind == kind, size=int(np.count_nonzero(host_kind == kind)))
        index = index.squeeze(1)
        logp = scored_logp(self.hidden.detach().index_select(0, index), self.batch.targets.index_select(0, index))
        return logp.new_zeros(self.batch.targets.shape).index_copy_(0, index, logp)

    def loss(self, **inputs):
        """`fused_linear_erpo_loss` on the hidden states and the lm_head; `inputs` as `LogitsScorer.loss`. The batch's
        host layout (`completion_rows`' read) spares the chunk plan its own read. The head's computation returns the
        loss tensor alone (`on_whole_lm_head`: what DeepSpeed ZeRO-3 hooks), put back into the loss's output."""
        b = self.batch
        outputs = []

        def loss_on_head(weight, bias, hidden):
            outputs.append(fused_linear_erpo_loss(hidden, weight, b.targets, b.token_kind, b.sample_index, bias=bias,
                                                  host_layout=b.host_layout, workspace_bytes=self.workspace_bytes,
                                                  **inputs))
            return outputs[-1].loss

        loss = self.on_head(loss_on_head, self.hidden)
        return dataclasses.replace(outputs[-1], loss=loss)
