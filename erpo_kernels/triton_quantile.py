"""The entropy filter's threshold on the device: `objective.masked_quantile` over the response rows in one sort and
one Triton program, so the fused objective (`triton_objective`) can take it as a tensor (no host read).

The rows outside the pool sort to +inf behind the n pooled values (`torch.sort`); the program counts n and the
pooled NaNs, forms torch.quantile's fp32 rank q (n - 1) and lerps between the order statistics at floor(rank) and
ceil(rank) with torch.lerp's formula (the same two branches, each one fma), NaN when n = 0 or a pooled value is NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import clamp

BLOCK_ROWS = 1024  # rows per step of the counting loop


@triton.jit
def _masked_quantile_kernel(sorted_ptr, kind_ptr, values_ptr, out_ptr, num_rows, q, POOL_KIND: tl.constexpr,
                            BLOCK: tl.constexpr):
    pooled_rows = tl.zeros([BLOCK], dtype=tl.int32)
    pooled_nan = tl.zeros([BLOCK], dtype=tl.int32)
    block_start = 0
    while block_start < num_rows:  # triton_common's note on loop bounds
        rows = block_start + tl.arange(0, BLOCK)
        inside = rows < num_rows
        pooled = inside & (tl.load(kind_ptr + rows, mask=inside, other=0) == POOL_KIND)
        value = tl.load(values_ptr + rows, mask=pooled, other=0.0)
        pooled_rows += pooled.to(tl.int32)
        pooled_nan += (pooled & (value != value)).to(tl.int32)
        block_start += BLOCK
    count = tl.sum(pooled_rows, axis=0)
    rank = clamp(q * (count - 1).to(tl.float32), 0.0, None)  # count = 0: rank 0 (the result is NaN below)
    below = rank.to(tl.int64)  # floor: rank >= 0
    above = tl.where(below.to(tl.float32) < rank, below + 1, below)  # ceil
    # an empty pool reads nothing (no rows at all: nothing to read; else two of the +inf the other rows sort to, and
    # end - start would form inf - inf): 0 instead (its result is the NaN of `undefined` below either way)
    start = tl.load(sorted_ptr + below, mask=count > 0, other=0.0)
    end = tl.load(sorted_ptr + above, mask=count > 0, other=0.0)
    weight = rank - below.to(tl.float32)
    # torch.lerp's two branches, each one fused multiply-add as torch's compiled lerp is (an fp32 product is exact in
    # fp64, so the fp64 sum rounded to fp32 is that fma: the same bits under the interpreter and on a GPU)
    difference = (end - start).to(tl.float64)
    small = weight.to(tl.float64) * difference + start.to(tl.float64)
    large = end.to(tl.float64) - difference * (1.0 - weight).to(tl.float64)
    quantile = tl.where(weight < 0.5, small, large).to(tl.float32)
    undefined = (count == 0) | (tl.sum(pooled_nan, axis=0) > 0)
    tl.store(out_ptr, tl.where(undefined, float("nan"), quantile))


@torch.library.custom_op("erpo::triton_masked_quantile", mutates_args=())
def masked_quantile_op(values: torch.Tensor, token_kind: torch.Tensor, pool_kind: int, q: float) -> torch.Tensor:
    """0-dim fp32: torch.quantile(values[token_kind == pool_kind], q) (linear interpolation; NaN when no row is
    pooled or a pooled value is NaN), as `objective.masked_quantile`. values [N] fp32 (N >= 0), token_kind [N]."""
    pooled = torch.where(token_kind == pool_kind, values, float("inf")).sort().values
    quantile = torch.empty((), dtype=torch.float32, device=values.device)
    _masked_quantile_kernel[(1,)](pooled, token_kind, values, quantile, values.shape[0], q, POOL_KIND=pool_kind,
                                  BLOCK=BLOCK_ROWS)
    return quantile


@masked_quantile_op.register_fake
def _(values, token_kind, pool_kind, q):
    return values.new_empty((), dtype=torch.float32)
