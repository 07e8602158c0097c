"""Per-sample sums of per-token values: [N] -> [S], differentiable (the torch reference's; the Triton path's
deterministic twin with the same interface is triton_segment.TritonSegmentSum)."""
from __future__ import annotations

import torch


class SegmentSum:
    """Sums of per-token values [N] into `num_samples` bins by `sample_index` [N] (every entry in [0, S)).

    Build once per row -> sample map and call it on each [N] vector; returns [S] fp32 (fp64 for fp64 values: the
    float64 tests), differentiable. Rows that must not count should carry a value of 0. (`index_add` uses float
    atomics on CUDA: use TritonSegmentSum there when the sums must repeat bit for bit.)
    """

    def __init__(self, sample_index: torch.Tensor, num_samples: int):
        self.sample_index = sample_index
        self.num_samples = num_samples

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
        out = torch.zeros(self.num_samples, dtype=dtype, device=values.device)
        return out.index_add(0, self.sample_index, values.to(dtype))
