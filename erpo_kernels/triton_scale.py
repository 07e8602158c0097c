"""The fused-linear loss's backward: its stored gradients times the incoming gradient, read on the device.

    out = x * scale        x any float dtype, scale a 0-dim fp32 tensor, out of a float dtype of its own; each
                           product formed in fp32 and rounded once to out's dtype, to nearest even, as
                           (x.float() * scale).to(dtype)

One launch per tensor, contiguous blocks of BLOCK elements: a memory-bound pass at the copy rate. The loss keeps
d weight in its fp32 accumulator until this pass, which rounds it to the weight's dtype once
(fused_linear_loss.GradientGroups).
torch's `x * scale` with a 0-dim CUDA tensor of another dtype broadcasts it (stride 0) and casts, which takes its
non-vectorized kernel (2.45 ms for the bf16 d weight and d hidden of Qwen2.5-7B at N = 16384 on an H200, about 1 TB/s,
profiled at commit 2ab6bb9), and it rounds the scale to x's dtype before the product, as `torch._foreach_mul` does
on its vectorized path (taken only when the scalar has x's dtype).

The rounding to bf16 is written out (`_round_to_bfloat16`): Triton 3.6's interpreter truncates an fp32 -> bf16
cast, so the CPU would round otherwise than the GPU's cvt.rn and torch's `.to(torch.bfloat16)`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _round_to_bfloat16(x):
    """fp32 x to bf16, to nearest even (ties to the even 16-bit pattern), as torch's c10::BFloat16: the upper 16 bits of
    x's bits plus 0x7FFF plus the kept part's lowest bit (a carry into the exponent rounds up to the next binade or to
    infinity); a NaN stays a (quiet) NaN, which the carry could turn into infinity."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _scale_kernel(x_ptr, out_ptr, scale_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    scale = tl.load(scale_ptr)
    product = tl.load(x_ptr + offsets, mask=inside).to(tl.float32) * scale
    if out_ptr.dtype.element_ty == tl.bfloat16:
        out = _round_to_bfloat16(product)
    else:
        out = product.to(out_ptr.dtype.element_ty)  # fp16 and fp32: the interpreter's numpy cast rounds to nearest
    tl.store(out_ptr + offsets, out, mask=inside)


@torch.library.custom_op("erpo::triton_scaled", mutates_args=())
def scaled_op(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (any shape, float) times scale (0-dim, on x's device), in `dtype` (module docstring)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel():
        _scale_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, scale.float().contiguous(), x.numel(), BLOCK=BLOCK)
    return out


@scaled_op.register_fake
def _(x, scale, dtype):
    return torch.empty(x.shape, dtype=dtype, device=x.device)
