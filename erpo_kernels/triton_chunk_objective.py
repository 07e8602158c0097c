"""The fused-linear path's per-chunk objective gradient on the Triton objective's kernels (`triton_objective`):
d loss / d logp_t and d loss / d H_t on one chunk's rows, with no autograd, in two launches per chunk and work in
proportion to the rows the chunk's samples hold.

    once     the host layout (`chunk_layout`, from token_kind and sample_index, uploaded in one copy): per chunk,
             the samples with scored rows in it, each with its scored rows in row order;
             the entropy filter's threshold (`triton_quantile`: over the pre-passed response rows, or over the
             gathered pool with top_entropy_gather);
             the global factors (1 / num_items or 1 / num_seqs for the terms, 1 / the query samples for the
             Query-KL, 1 / the kept rows for the token-mean entropy bonus): kernels 1 and 2 over every sample on the
             pre-pass vectors. They read counts alone, known before any chunk: the row and sample counts from
             token_kind, the kept rows from the response rows' entropies, all pre-passed whenever the entropy
             filter's count enters a gradient (`fused_linear_loss.plan_chunks`)
    chunk c  kernel 1 on c's samples only (program p runs sample sample_ids[p]): each walks its scored rows, its
             rows outside c holding the pre-pass values or an earlier chunk's, and writes its rows' coefficients;
             kernel 3 on c's rows: coefficient x global factor

Why a chunk's coefficients are exact: a row's coefficient reads its own values, its sample's sums and counts, and
the global factors. A sample whole in c has every row live. A sample split by a cut has its coupled rows pre-passed
(the query rows when the Query-KL reads ell_theta(q); the response rows when a per-sample response value is read:
the sequence-level ratio, VESPO's weight, the off-policy mask's drift, the kept rows' weight sum behind the
sequence-level gradient); its other rows outside c hold zeros (never pre-passed) and enter no sum a coefficient
of c reads. Its row counts come from token_kind, whatever the values.

Cost per chunk: kernel 1 reads the scored rows of the samples c touches (c's own, plus the other rows of a sample a
cut splits: a sample spread over k chunks is read k times), kernel 3 the rows of c; once: the layout's upload, one
pass of kernels 1 and 2 over every row, and, with the entropy filter, one sort of the rows for the threshold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from .common import host_to_device
from .triton_objective import (
    SampleOutputs,
    fp32_loss_tensors,
    launch_finish_kernel,
    launch_grad_kernel,
    launch_sample_kernel,
    objective_settings,
    tensor_denominators,
)
from .triton_quantile import masked_quantile_op
from .validation import LossInputs, LossOptions


@dataclass(frozen=True)
class ChunkLayout:
    """Where kernel 1 finds each sample's rows, int64 host arrays. Every sample: its scored rows `rows_by_sample`
    [R] (row order within a sample), sample s at rows_by_sample[sample_starts[s]:sample_starts[s + 1]]
    (sample_starts [S + 1]). Chunk c: programs program_offsets[c] to program_offsets[c + 1] (program_offsets
    [C + 1]), program p running sample sample_ids[p] over chunk_rows[program_starts[p]:program_starts[p + 1]]
    (sample_ids [P], program_starts [P + 1], chunk_rows [R'])."""

    sample_starts: np.ndarray
    rows_by_sample: np.ndarray
    program_offsets: np.ndarray
    sample_ids: np.ndarray
    program_starts: np.ndarray
    chunk_rows: np.ndarray


def chunk_layout(chunks: List[Tuple[int, int]], token_kind: np.ndarray, sample_index: np.ndarray,
                 num_samples: int) -> ChunkLayout:
    """The `ChunkLayout` of `chunks` ((start, stop) row ranges) over host [N] token_kind and sample_index."""
    scored = np.nonzero(token_kind != 0)[0]
    samples = sample_index[scored].astype(np.int64)
    rows_by_sample = scored[np.argsort(samples, kind="stable")]
    sample_sizes = np.bincount(samples, minlength=num_samples)
    sample_starts = np.concatenate(([0], np.cumsum(sample_sizes)))
    # each chunk's samples, ascending: the distinct (chunk, sample) pairs of the scored rows, in one sort
    starts = np.array([start for start, _ in chunks], dtype=np.int64)
    stride = max(num_samples, 1)
    pairs = np.unique((np.searchsorted(starts, scored, side="right") - 1) * stride + samples)
    program_offsets = np.concatenate(([0], np.cumsum(np.bincount(pairs // stride, minlength=len(chunks)))))
    program_offsets = program_offsets.astype(np.int64)
    sample_ids = (pairs % stride).astype(np.int64)
    sizes = sample_sizes[sample_ids]
    program_starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    # position j of program p reads rows_by_sample[sample_starts[sample_ids[p]] + j - program_starts[p]]
    shift = np.repeat(sample_starts[sample_ids] - program_starts[:-1], sizes)
    chunk_rows = rows_by_sample[shift + np.arange(program_starts[-1], dtype=np.int64)]
    return ChunkLayout(sample_starts.astype(np.int64), rows_by_sample.astype(np.int64), program_offsets, sample_ids,
                       program_starts, chunk_rows)


class TritonChunkObjective:
    """`gradient(c, rows)` -> (d loss / d logp, d loss / d H) [n] fp32 on chunk c's rows (module docstring).

    logp, entropy [N] fp32: the vectors the chunks fill (pre-pass values at first; chunk c's own written before its
    `gradient`), read by reference as they change; token_kind [N] on the device; chunks and the host token_kind,
    sample_index as `chunk_layout`'s; inputs, options validated; entropy_pool [m] fp32: the filter's pool when
    options.top_entropy_gather gathered one (fused_linear_erpo_loss does it before the op), else None."""

    def __init__(self, chunks, host_kind: np.ndarray, host_sample: np.ndarray, logp, entropy, token_kind,
                 inputs: LossInputs, options: LossOptions, entropy_pool: Optional[torch.Tensor]):
        device = logp.device
        num_samples = inputs.advantages.shape[0]
        layout = chunk_layout(chunks, host_kind, host_sample, num_samples)
        parts = [layout.sample_starts, layout.rows_by_sample, layout.sample_ids, layout.program_starts,
                 layout.chunk_rows]
        uploaded = host_to_device(np.concatenate(parts), device).split([len(part) for part in parts])
        sample_starts, rows_by_sample, self.sample_ids, self.program_starts, self.chunk_rows = uploaded
        self.program_offsets = layout.program_offsets.tolist()
        self.logp, self.entropy, self.token_kind = logp, entropy, token_kind.contiguous()
        self.loss_tensors = fp32_loss_tensors(inputs)
        self.settings = objective_settings(options, inputs, has_entropy=True)
        self.threshold = _entropy_threshold(entropy, self.token_kind, options, entropy_pool)
        self.outputs = SampleOutputs.empty(logp.shape[0], num_samples, device)
        launch_sample_kernel(self.outputs, logp, entropy, self.token_kind, rows_by_sample, sample_starts, None,
                             self.loss_tensors, self.threshold, self.settings)
        self.scales = launch_finish_kernel(self.outputs, *tensor_denominators(options), self.settings)[3]
        self.grad_loss = torch.ones((), dtype=torch.float32, device=device)  # d loss / d loss: the op's backward
        # scales the stored gradients by the incoming one

    def gradient(self, chunk: int, rows: slice):
        first, last = self.program_offsets[chunk], self.program_offsets[chunk + 1]
        launch_sample_kernel(self.outputs, self.logp, self.entropy, self.token_kind, self.chunk_rows,
                             self.program_starts[first:last + 1], self.sample_ids[first:last], self.loss_tensors,
                             self.threshold, self.settings)
        return launch_grad_kernel(self.grad_loss, self.token_kind[rows], self.outputs.coef_logp[rows],
                                  self.outputs.coef_entropy[rows], self.scales)


def _entropy_threshold(entropy, token_kind, options: LossOptions, entropy_pool):
    """The entropy filter's threshold [] fp32, the (1 - top_entropy_quantile)-quantile of the response rows'
    entropies (all pre-passed) or of the gathered pool (NaN for an empty pool: no row kept, as the reference); None
    without the filter."""
    if options.top_entropy_quantile >= 1.0:
        return None
    q = 1.0 - options.top_entropy_quantile
    if options.top_entropy_gather is None:
        return masked_quantile_op(entropy, token_kind, 2, q)
    if entropy_pool is None:
        raise ValueError("top_entropy_gather needs the gathered pool (entropy_pool): fused_linear_erpo_loss "
                         "gathers it before the chunks")
    if entropy_pool.numel() == 0:
        return torch.full((), float("nan"), device=entropy.device)
    pool = entropy_pool.float().contiguous()
    return masked_quantile_op(pool, torch.ones_like(pool, dtype=torch.int8), 1, q)
