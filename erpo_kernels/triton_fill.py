"""Zeros written into up to three fp32 buffers in one launch: the fused-linear op's [N] log-prob and entropy vectors
(the objective's pass over every sample reads each row before the chunks form it: zeros, never garbage) and its
0-dim anchor, which took three aten fills, one kernel launch each (fused_linear_loss.loss_gradients).

    out_k[i] = 0.0    for every i < numel(out_k), k = 1, 2, 3; program p writes elements p BLOCK to (p + 1) BLOCK
                      of each

The buffers cannot be views of one zero-filled allocation: a custom op's outputs may not alias one another.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _zero_kernel(first_ptr, second_ptr, third_ptr, first_numel, second_numel, third_numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    zeros = tl.zeros([BLOCK], dtype=tl.float32)
    tl.store(first_ptr + offsets, zeros, mask=offsets < first_numel)
    tl.store(second_ptr + offsets, zeros, mask=offsets < second_numel)
    tl.store(third_ptr + offsets, zeros, mask=offsets < third_numel)


def zero_fill(first: torch.Tensor, second: torch.Tensor, third: torch.Tensor) -> None:
    """Write 0.0 into every element of the three contiguous fp32 tensors (any shapes, one device)."""
    tensors = (first, second, third)
    largest = max(t.numel() for t in tensors)
    if largest:
        _zero_kernel[(-(-largest // BLOCK),)](  # cdiv (triton.cdiv is a jit call: ~10 us)
            *tensors, *(t.numel() for t in tensors), BLOCK=BLOCK)
