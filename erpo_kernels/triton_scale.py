"""The fused-linear loss's backward: its stored gradients times the incoming gradient, read on the device.

    out = x * scale        x any float dtype, scale a 0-dim fp32 tensor; each product formed in fp32 and rounded
                           once to x's dtype, as (x.float() * scale).to(x.dtype) (compiled, to nearest even;
                           Triton 3.6's interpreter truncates fp32 to bf16, one ulp at most)

One launch per tensor, contiguous blocks of BLOCK elements: a memory-bound pass at the copy rate. torch's `x * scale`
with a 0-dim CUDA tensor of another dtype broadcasts it (stride 0) and casts, which takes its non-vectorized kernel
(2.45 ms for the bf16 d weight and d hidden of Qwen2.5-7B at N = 16384 on an H200, about 1 TB/s, profiled at commit
2ab6bb9), and it rounds the scale to x's dtype before the product, as `torch._foreach_mul` does on its vectorized
path (taken only when the scalar has x's dtype).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _scale_kernel(x_ptr, out_ptr, scale_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    scale = tl.load(scale_ptr)
    x = tl.load(x_ptr + offsets, mask=inside)
    tl.store(out_ptr + offsets, (x.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=inside)


@torch.library.custom_op("erpo::triton_scaled", mutates_args=())
def scaled_op(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any shape, float) times scale (0-dim, on x's device), in x's dtype (module docstring)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        _scale_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, scale.float().contiguous(), x.numel(), BLOCK=BLOCK)
    return out


@scaled_op.register_fake
def _(x, scale):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
