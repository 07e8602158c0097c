"""DeepSpeed ZeRO-3: the lm_head weight for the fused-linear loss, which reads it outside the head's forward.

Under ZeRO-3 every parameter is partitioned; DeepSpeed gathers a module's parameters only around that module's
own forward (and again around its backward, through hooks on the forward's outputs). The fused loss never calls
`lm_head.forward`, so `lm_head.weight` read directly is an empty shard, and nothing would gather it again when
the loss's backward needs it. (`deepspeed.zero.register_external_parameter(module, p)` only helps when the use
happens inside `module.forward`; the loss is computed after the model's forward has returned.)

`gathered_lm_head` therefore holds the head's parameters gathered (`GatheredParameters(..., modifier_rank=None)`:
every rank gets the full tensor, no rank's edits are broadcast back) from the loss's forward through its
backward. Run the backward (`engine.backward(loss)`) inside the block: the fused backward then sees the whole
weight and the weight's gradient (full [V, D], summed with the input-embedding part when the head is tied)
reaches DeepSpeed's per-parameter gradient hook, which reduce-scatters it into the rank's partition exactly as
for a parameter used inside a forward. If the backward runs after the block, the fused backward raises an error
instead of using the re-partitioned (empty) weight. Without ZeRO-3 the context manager gathers nothing.
"""
from __future__ import annotations

import contextlib

import torch


def find_lm_head(module: torch.nn.Module) -> torch.nn.Module:
    """The output projection of a causal LM (also through a DeepSpeed engine's `.module`), or `module` itself."""
    for candidate in (module, getattr(module, "module", None)):
        get_head = getattr(candidate, "get_output_embeddings", None)
        if callable(get_head) and get_head() is not None:
            return get_head()
    if isinstance(getattr(module, "weight", None), torch.Tensor):
        return module
    raise TypeError(f"module must be an lm_head (a module with .weight [V, D]) or a model with "
                    f"get_output_embeddings(); got {type(module).__name__}")


def is_zero3_partitioned(param: torch.Tensor) -> bool:
    """True when DeepSpeed ZeRO-3 manages `param` (it then carries a `ds_id`)."""
    return hasattr(param, "ds_id")


@contextlib.contextmanager
def gathered_lm_head(module: torch.nn.Module):
    """Yield `(weight [V, D], bias [V] or None)` of the lm_head of `module` (an lm_head, a causal LM with
    `get_output_embeddings()`, or a DeepSpeed engine around one), whole on every rank while the block runs.

    Collective under ZeRO-3: every rank must enter the block. Compute the fused loss and run its backward inside:

        hidden = engine(input_ids, ...)                   # [N, D] final hidden states
        with gathered_lm_head(engine) as (weight, bias):
            out = fused_linear_erpo_loss(hidden, weight, targets, token_kind, sample_index, bias=bias, ...)
            engine.backward(out.loss)
        engine.step()
    """
    head = find_lm_head(module)
    weight, bias = head.weight, getattr(head, "bias", None)
    params = [p for p in (weight, bias) if isinstance(p, torch.Tensor) and is_zero3_partitioned(p)]
    if not params:
        yield weight, bias
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield weight, bias
