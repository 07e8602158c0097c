"""The fused-linear loss's d weight operand on the Triton backend: a chunk's hidden rows, those that receive no
gradient zeroed, written into its rows of the group's buffer.

    out[i, :] = hidden[i, :]  where receives(i) = (targets[i] != -100 and g_logp[i] != 0) or g_H[i] != 0
                0             elsewhere              (`common.rows_receiving_gradient`; NaN != 0, so a NaN gradient
                                                      keeps its row)

d weight += dlogits.T @ out: a row without gradient has exactly zero dlogits, but a non-finite hidden row (a padding
row of a fully masked attention) would still make 0 * inf = NaN in the product; zeroing its hidden row instead keeps
d weight finite. The values are those of `torch.where(receives[:, None], hidden, 0.0)` (a copy or +0.0). One
launch per chunk, a program per (row, BLOCK_D columns), in place of the mask's five elementwise ops, its copy into a
[N] mask and the group's torch.where (fused_linear_loss.GradientGroups).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validation import IGNORE_INDEX

MAX_BLOCK_D = 1024  # columns a program copies (D = 3584 for Qwen2.5-7B: 4 programs a row)


@triton.jit
def _gradient_rows_kernel(hidden_ptr, hidden_stride, targets_ptr, grad_logp_ptr, grad_entropy_ptr, out_ptr,
                          out_stride, hidden_dim, BLOCK_D: tl.constexpr,
                          _IGNORE_INDEX: tl.constexpr = IGNORE_INDEX):
    # IGNORE_INDEX a parameter with a plain number as its default, which no launch passes: a global read here would
    # be checked on each of the kernel's launches (one per chunk; `triton_row_checks`' note)
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = columns < hidden_dim
    g_logp = tl.load(grad_logp_ptr + row)
    g_entropy = tl.load(grad_entropy_ptr + row)
    receives = ((tl.load(targets_ptr + row) != _IGNORE_INDEX) & (g_logp != 0)) | (g_entropy != 0)
    # a row without gradient is not even read: its zeros come from `other`
    values = tl.load(hidden_ptr + row * hidden_stride + columns, mask=inside & receives, other=0.0)
    tl.store(out_ptr + row * out_stride + columns, values, mask=inside)


def gradient_rows_into(out: torch.Tensor, hidden_rows: torch.Tensor, targets: torch.Tensor,
                       grad_logp: torch.Tensor, grad_entropy: torch.Tensor) -> None:
    """Write hidden_rows [n, D] into out [n, D] (hidden's dtype, unit column stride), the rows that receive no
    gradient zeroed (module docstring); targets [n] int64, grad_logp, grad_entropy [n] fp32, all on one device."""
    num_rows, hidden_dim = hidden_rows.shape
    if num_rows == 0 or hidden_dim == 0:
        return
    block_d = min(1 << (hidden_dim - 1).bit_length(), MAX_BLOCK_D)  # the power of two >= D, at most MAX_BLOCK_D
    _gradient_rows_kernel[(num_rows, -(-hidden_dim // block_d))](  # cdiv (triton.cdiv is a jit call: ~10 us)
        hidden_rows, hidden_rows.stride(0), targets, grad_logp, grad_entropy, out, out.stride(0), hidden_dim,
        BLOCK_D=block_d)
