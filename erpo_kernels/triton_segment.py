"""Deterministic per-sample sums on the Triton path: [N] -> [S], differentiable (torch twin: segment.SegmentSum).

`torch.Tensor.index_add_` uses float atomics on CUDA, so its result can change from run to run. Here the rows are
sorted by sample once per loss call (a stable integer sort, shared by every sum of that call) and one program sums
each sample's rows in a fixed order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _segment_sum_kernel(values_ptr, order_ptr, starts_ptr, out_ptr, BLOCK: tl.constexpr):
    segment = tl.program_id(0).to(tl.int64)
    start = tl.load(starts_ptr + segment)
    stop = tl.load(starts_ptr + segment + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    block_start = start
    while block_start < stop:  # triton_common's note on loop bounds
        offs = block_start + tl.arange(0, BLOCK)
        mask = offs < stop
        rows = tl.load(order_ptr + offs, mask=mask, other=0)
        acc += tl.load(values_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        block_start += BLOCK
    tl.store(out_ptr + segment, tl.sum(acc, axis=0))


@torch.library.custom_op("erpo::triton_segment_sum", mutates_args=())
def segment_sum_op(values: torch.Tensor, sample_index: torch.Tensor, order: torch.Tensor,
                   starts: torch.Tensor) -> torch.Tensor:
    """values [N] -> [S] fp32 sums by sample; order [N] (the rows sorted by sample_index [N]) and starts [S + 1]
    (each sample's first position in `order`) from `TritonSegmentSum`. A torch.library op: torch.compile keeps it
    whole (no graph break)."""
    num_samples = starts.shape[0] - 1
    out = torch.empty(num_samples, dtype=torch.float32, device=values.device)
    if num_samples > 0:
        _segment_sum_kernel[(num_samples,)](values.float().contiguous(), order, starts, out, BLOCK=256)
    return out


@segment_sum_op.register_fake
def _(values, sample_index, order, starts):
    return values.new_empty(starts.shape[0] - 1, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    values, sample_index, _, _ = inputs
    ctx.save_for_backward(sample_index)
    ctx.values_dtype = values.dtype


def _backward(ctx, grad_out):
    (sample_index,) = ctx.saved_tensors
    return grad_out[sample_index].to(ctx.values_dtype), None, None, None


segment_sum_op.register_autograd(_backward, setup_context=_setup_context)


class TritonSegmentSum:
    """`segment.SegmentSum`'s interface, deterministic on CUDA: the stable sort of the rows by sample and the
    segment starts are computed once here (no host-device sync) and shared by every call."""

    def __init__(self, sample_index: torch.Tensor, num_samples: int):
        self.sample_index = sample_index
        sorted_samples, self.order = torch.sort(sample_index, stable=True)
        bins = torch.arange(num_samples + 1, dtype=sorted_samples.dtype, device=sample_index.device)
        self.starts = torch.searchsorted(sorted_samples, bins)

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        return segment_sum_op(values, self.sample_index, self.order, self.starts)
