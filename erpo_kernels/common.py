"""Small torch helpers shared by the torch reference, the torch fused-linear backend and the Triton host code, so
that none of them imports another (the reference stays an independent oracle of the Triton path).

The online log-sum-exp with entropy, torch side (its Triton twin is `triton_common.online_softmax_step`). Over a
row's logits z seen part by part, three running values suffice:

    running_max m,   sum_exp s = sum_j exp(z_j - m),   sum_exp_shifted u = sum_j exp(z_j - m) (z_j - m)
    lse = m + log s,   H = log s - u / s                (no cancellation between two large terms)

The -inf convention (the same in both languages): m starts at, and never falls below, the finite LSE_FLOOR, so the
rescale (m_old - m_new) * s never forms inf * 0; logits outside the row are -inf, so they add exp(-inf) = 0 to s
and nothing to u (u adds e * d only where e > 0). A row whose logits are all -inf gets s = 0, lse = -inf, H = NaN.
"""
from __future__ import annotations

import numpy as np
import torch

from .validation import IGNORE_INDEX

LSE_FLOOR = -3.0e38  # finite floor of the running max (see the module docstring)


def host_to_device(host: torch.Tensor | np.ndarray, device: torch.device | str) -> torch.Tensor:
    """`host` (a tensor in host memory or a numpy array, any shape) as a tensor on `device`, the host not waiting: on
    CUDA copied with non_blocking from pinned memory (from pageable memory the driver may make the host wait for the
    stream before it stages the copy, and a blocking copy waits for every kernel queued before it; the caching host
    allocator keeps the pinned block until the copy is done; a tensor already pinned is copied from where it lies).
    Under torch.compile the copy is traced from `host` as it lies (FakeTensor cannot pin: `aten._pin_memory` is not
    implemented), with non_blocking: the graph's copy waits for nothing when its caller pinned `host`. On the CPU,
    `host` itself (a numpy array shares its memory)."""
    host, device = torch.as_tensor(host), torch.device(device)
    if _uploads_pinned(device):
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _uploads_pinned(device: torch.device | str) -> bool:
    """Whether an upload to `device` goes from pinned host memory: on CUDA, outside torch.compile (FakeTensor
    cannot pin)."""
    return torch.device(device).type == "cuda" and not torch.compiler.is_compiling()


def staging_for(device: torch.device | str, size: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty [size] host tensor of `dtype` to fill and hand to `host_to_device` for `device`: pinned on CUDA
    (outside torch.compile), so that the upload copies it from where it lies instead of first copying it into a
    pinned block (host time before the copy, which the GPU may be waiting for); plain host memory elsewhere."""
    return torch.empty(size, dtype=dtype, pin_memory=_uploads_pinned(device))


def index_slices(size: int, step: int) -> list[slice]:
    """[0, size) cut into consecutive slices of `step` indices (the last may be shorter)."""
    return [slice(start, min(start + step, size)) for start in range(0, size, step)]


def rows_receiving_gradient(targets: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
    """[N] bool: rows whose logits gradient is not identically zero (a scored row with d loss / d logp_t != 0, or
    d loss / d H_t != 0); every other row gets an exactly zero gradient, whatever its logits hold."""
    return ((targets != IGNORE_INDEX) & (grad_logp != 0)) | (grad_entropy != 0)


def transform_logits(logits: torch.Tensor, transform) -> torch.Tensor:
    """z = softcap(logits * logit_scale) / temperature (`validation.LogitTransform`) on fp32 logits, as torch ops
    (autograd differentiates them in the reference; the torch fused backward takes `transform_slope`)."""
    z = logits * transform.logit_scale
    if transform.logit_softcap is not None:
        z = transform.logit_softcap * torch.tanh(z / transform.logit_softcap)
    return z / transform.temperature


def transform_slope(logits: torch.Tensor, transform):
    """d z / d logits of `transform_logits`, element-wise: logit_scale / temperature, times
    1 - tanh^2(x) = 1 / cosh^2(x) at x = logits * logit_scale / logit_softcap with a soft-cap (no cancellation
    near saturation; 0 once cosh overflows). A float without a soft-cap."""
    slope = transform.logit_scale / transform.temperature
    if transform.logit_softcap is None:
        return slope
    return slope * torch.cosh(logits * (transform.logit_scale / transform.logit_softcap)).square().reciprocal()


def softmax_partials(z: torch.Tensor):
    """Online-softmax partials of one block of fp32 logits z [n, v]: (running_max, sum_exp, sum_exp_shifted),
    each [n] fp32, under the module docstring's -inf convention."""
    running_max = z.amax(1).clamp(min=LSE_FLOOR)
    shifted = z - running_max.unsqueeze(1)
    e = shifted.exp()
    return running_max, e.sum(1), torch.where(e > 0, e * shifted, 0.0).sum(1)


def merge_partials(running_max, sum_exp, sum_exp_shifted, target_logit, targets):
    """Merge per-vocabulary-part partials, each [P, n] fp32 (running_max, sum_exp, sum_exp_shifted and the target
    logit, 0 in parts that do not hold it), in a fixed order into (logp, entropy, lse), each [n] fp32.

    logp is clamped to <= 0 (it is z_t - lse with z_t one of the terms of lse) and is 0 where targets == -100.
    """
    row_max = running_max.amax(0)
    offset = running_max - row_max
    scale = torch.exp(offset)
    total_exp = (scale * sum_exp).sum(0)
    total_shifted = (scale * (sum_exp_shifted + offset * sum_exp)).sum(0)
    log_sum_exp = torch.log(total_exp)
    lse = row_max + log_sum_exp
    entropy = log_sum_exp - total_shifted / total_exp
    logp = torch.where(targets != IGNORE_INDEX, (target_logit.sum(0) - lse).clamp(max=0.0), 0.0)
    return logp, entropy, lse
