"""The whole lm_head for the fused-linear loss, whatever shards it: DeepSpeed ZeRO-3, FSDP2 or nothing.

The fused-linear loss reads `lm_head.weight` [V, D] outside the head's forward. Sharded training keeps that
weight whole only around the module's own forward, so `whole_lm_head(model)` holds it whole while the loss and
its backward run:

- DeepSpeed ZeRO-3 (parameters carry a `ds_id`): `erpo_kernels.zero3.gathered_lm_head`.
- FSDP2 (`torch.distributed.fsdp.fully_shard`; the head's parameters are then `DTensor` shards outside the
  forward): `unshard()` on the `FSDPModule` whose parameter group holds the head (the head itself or its nearest
  `fully_shard` ancestor; the lowest common ancestor for an lm_head tied to the input embedding, as FSDP2 requires
  of shared parameters), and `reshard()` when the block ends. The loss's backward accumulates the weight's
  gradient into the unsharded parameter, and FSDP2 reduce-scatters it into the shards at the end of the backward
  (its post-backward runs for every parameter group, also one whose forward output got no gradient), summed with
  the input-embedding part when the head is tied. When the model's forward left the group unsharded (the root
  module, which FSDP2 keeps unsharded from its forward until its backward), the block changes nothing.
- Otherwise: the head's own parameters.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from .zero3 import find_lm_head, gathered_lm_head


def is_dtensor(tensor) -> bool:
    """True when `tensor` is a `torch.distributed.tensor.DTensor` (an FSDP2 shard outside its module's forward).
    Imports nothing: no DTensor exists before `torch.distributed.tensor` is imported."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def _fsdp_owner(model: torch.nn.Module, head: torch.nn.Module) -> torch.nn.Module:
    """The `FSDPModule` managing `head`'s parameters: the deepest `fully_shard` module of `model` that contains
    `head` (or is it)."""
    from torch.distributed.fsdp import FSDPModule

    owners = [module for module in model.modules()   # pre-order: ancestors before descendants
              if isinstance(module, FSDPModule) and any(sub is head for sub in module.modules())]
    if not owners:
        raise ValueError("lm_head.weight is a DTensor but no fully_shard (FSDP2) module holds it: pass the model "
                         "that fully_shard was applied to (or its lm_head, if sharded on its own)")
    return owners[-1]


@contextlib.contextmanager
def whole_lm_head(model: torch.nn.Module):
    """Yield `(weight [V, D], bias [V] or None)` of the lm_head of `model` (an lm_head, a causal LM with
    `get_output_embeddings()`, a DeepSpeed engine around one, or a model sharded with FSDP2's `fully_shard`),
    whole on every rank while the block runs; the weight's gradient reaches the shards.

    Collective when the head is sharded: every rank must enter the block. Compute the fused loss and run its
    backward inside:

        hidden = model.model(input_ids).last_hidden_state.flatten(0, 1)   # [N, D] final hidden states
        with whole_lm_head(model) as (weight, bias):
            out = fused_linear_erpo_loss(hidden, weight, targets, token_kind, sample_index, bias=bias, ...)
            out.loss.backward()                            # engine.backward(out.loss) under DeepSpeed
        optimizer.step()
    """
    head = find_lm_head(model)
    if not is_dtensor(head.weight):
        with gathered_lm_head(model) as (weight, bias):
            yield weight, bias
        return
    owner = _fsdp_owner(model, head)
    owner.unshard()
    try:
        yield head.weight, getattr(head, "bias", None)
    finally:
        owner.reshard()
