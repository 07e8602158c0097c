"""The fused-linear path's per-chunk objective gradient on the Triton objective's kernels (`triton_objective`):
d loss / d logp_t and d loss / d H_t on one chunk's rows, with no autograd, in two launches per chunk and work in
proportion to the rows the chunk's samples hold.

    once     the global factors (1 / num_items or 1 / num_seqs for the terms, 1 / the query samples for the
             Query-KL, 1 / the kept rows for the token-mean entropy bonus): kernels 1 and 2 over every sample, each
             program walking its sample's span of scored rows (`triton_segment.sample_spans`, found on the device
             before the op: no host layout). They read counts alone, exact integers in fp32 whichever rows a program
             walks: the row and sample counts from token_kind and sample_index, so without the entropy filter they
             are launched before the call's host read (the op's setup, on the zeroed vectors); with it the kept rows
             too, from the response rows' entropies, all pre-passed whenever the entropy filter's count enters a
             gradient (`fused_linear_loss.plan_chunks`), so then after the pre-pass, on its values;
             the host layout (`chunk_layout`, from token_kind and sample_index, uploaded in one copy): every
             sample's scored rows in row order, and per chunk the samples with scored rows in it;
             the entropy filter's threshold (`triton_quantile`: over the pre-passed response rows, or over the
             gathered pool with top_entropy_gather)
    chunk c  kernel 1 on c's samples only (program p runs sample sample_ids[p] over its rows where the pass over
             every sample found them: the kernel indexes the samples' row ranges by sample, no copy per chunk):
             each walks its scored rows, its rows outside c holding the pre-pass values or an earlier chunk's, and
             writes its rows' coefficients;
             kernel 3 on c's rows: coefficient x global factor

Why a chunk's coefficients are exact: a row's coefficient reads its own values, its sample's sums and counts, and
the global factors. A sample whole in c has every row live. A sample split by a cut has its coupled rows pre-passed
(the query rows when the Query-KL reads ell_theta(q); the response rows when a per-sample response value is read:
the sequence-level ratio, VESPO's weight, the off-policy mask's drift, the kept rows' weight sum behind the
sequence-level gradient); its other rows outside c hold zeros (never pre-passed) and enter no sum a coefficient
of c reads. Its row counts come from token_kind, whatever the values.

Cost per chunk: kernel 1 reads the scored rows of the samples c touches (c's own, plus the other rows of a sample a
cut splits: a sample spread over k chunks is read k times), kernel 3 the rows of c; once: the layout's upload, one
pass of kernels 1 and 2 over every sample's span, and, with the entropy filter, one sort of the rows for the
threshold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from .common import host_to_device, staging_for
from .triton_objective import (
    FinishOutputs,
    SampleOutputs,
    fp32_loss_tensors,
    launch_finish_kernel,
    launch_grad_kernel,
    launch_sample_kernel,
    objective_settings,
    tensor_denominators,
)
from .triton_quantile import masked_quantile_op
from .triton_segment import triton_sample_spans
from .validation import LossInputs, LossOptions


@dataclass(frozen=True)
class ChunkLayout:
    """Where kernel 1 finds each sample's rows, int64 host arrays. Every sample: its scored rows `rows_by_sample`
    [R] (row order within a sample), sample s at rows_by_sample[sample_starts[s]:sample_starts[s + 1]]
    (sample_starts [S + 1]). Chunk c: the samples with scored rows in it, ascending,
    sample_ids[program_offsets[c]:program_offsets[c + 1]] (sample_ids [P], program_offsets [C + 1]): its programs,
    each walking all its sample's rows where `rows_by_sample` holds them."""

    sample_starts: np.ndarray
    rows_by_sample: np.ndarray
    program_offsets: np.ndarray
    sample_ids: np.ndarray


def chunk_layout(chunks: List[Tuple[int, int]], token_kind: np.ndarray, sample_index: np.ndarray,
                 num_samples: int) -> ChunkLayout:
    """The `ChunkLayout` of `chunks` ((start, stop) row ranges covering the rows in order) over host [N]
    token_kind and sample_index: a few O(N) vectorised passes (host time between the call's read and its chunk
    loop), a sort only when the scored rows' samples are not ascending already (interleaved samples), a count per
    sample only then too (ascending ids give each sample's first row by a binary search)."""
    scored = np.flatnonzero(token_kind != 0)  # a boolean's nonzero: a third of an int64's time
    samples = sample_index[scored].astype(np.int64, copy=False)
    in_order = _ascending(samples)  # packed samples: their rows in row order are already grouped by sample
    rows_by_sample = scored if in_order else scored[np.argsort(samples, kind="stable")]
    if in_order and (samples.size == 0 or (samples[0] >= 0 and samples[-1] < num_samples)):
        # ascending ids within [0, S): each sample's first position by a binary search, no pass over the rows
        sample_starts = np.searchsorted(samples, np.arange(num_samples + 1, dtype=np.int64))
        rows_per_sample = np.diff(sample_starts)
    else:  # (ids out of range raise here)
        rows_per_sample = np.bincount(samples, minlength=num_samples)
        sample_starts = np.zeros(num_samples + 1, dtype=np.int64)
        np.cumsum(rows_per_sample, out=sample_starts[1:])
    # chunk c's scored rows are scored[bounds[c]:bounds[c + 1]] (the scored rows are ascending)
    bounds = np.searchsorted(scored, [start for start, _ in chunks] + [len(token_kind)])
    if in_order:
        program_offsets, sample_ids = _packed_chunk_samples(bounds, samples, rows_per_sample)
    else:  # each chunk's samples, ascending: the distinct (chunk, sample) pairs of the scored rows
        stride = max(num_samples, 1)
        pairs = np.unique(np.repeat(np.arange(len(chunks), dtype=np.int64) * stride, np.diff(bounds)) + samples)
        program_offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(np.bincount(pairs // stride, minlength=len(chunks)), out=program_offsets[1:])
        sample_ids = pairs % stride
    return ChunkLayout(sample_starts, rows_by_sample.astype(np.int64, copy=False), program_offsets, sample_ids)


def _packed_chunk_samples(bounds: np.ndarray, samples: np.ndarray, rows_per_sample: np.ndarray):
    """(program_offsets [C + 1], sample_ids [P]) of `ChunkLayout` when the scored rows' samples [R] ascend: chunk c
    (scored rows bounds[c] to bounds[c + 1]) holds the samples with rows from its first row's to its last row's, in
    that order. O(S + C): no pass over the rows (an O(N) key per row cost the call's host ~110 us at N = 16384)."""
    present = np.flatnonzero(rows_per_sample)  # the samples with scored rows, in the rows' order
    lo, hi = bounds[:-1], bounds[1:]
    filled = hi > lo
    first = np.searchsorted(present, samples[lo[filled]])
    last = np.searchsorted(present, samples[hi[filled] - 1], side="right")
    programs = np.zeros(lo.shape[0], dtype=np.int64)
    programs[filled] = last - first
    program_offsets = np.zeros(lo.shape[0] + 1, dtype=np.int64)
    np.cumsum(programs, out=program_offsets[1:])
    # program p of chunk c runs present[first[c] + p - program_offsets[c]]
    starts = np.zeros(lo.shape[0], dtype=np.int64)
    starts[filled] = first
    return program_offsets, present[np.repeat(starts - program_offsets[:-1], programs)
                                    + np.arange(program_offsets[-1], dtype=np.int64)]


def _ascending(values: np.ndarray) -> bool:
    """Whether values [n] never decrease."""
    return bool(np.all(values[1:] >= values[:-1]))


class TritonChunkObjective:
    """`gradient(c, rows)` -> (d loss / d logp, d loss / d H) [n] fp32 on chunk c's rows (module docstring), once
    `start` has run.

    logp, entropy [N] fp32: the vectors the chunks fill (zeros, then the pre-pass values; chunk c's own written
    before its `gradient`), read by reference as they change; token_kind, sample_index [N] on the device; spans [2, S]
    int64: each sample's span of scored rows (`triton_segment.sample_spans`' form, as the value checks' or the spans
    kernel leave it), or None (found here: one fill and one launch more); inputs, options validated; entropy_pool [m]
    fp32: the filter's pool when options.top_entropy_gather gathered one (fused_linear_erpo_loss does it before the
    op), else None. Made before the call's host read, with what needs no layout (the outputs of kernels 1 and 2, the
    [N] gradients whose rows each chunk's kernel 3 writes) and, without the entropy filter, kernels 1 and 2 over every
    sample (the global factors), so that `start`, between the read and the first chunk, is the layout's work
    alone."""

    def __init__(self, logp, entropy, token_kind, sample_index, spans, inputs: LossInputs, options: LossOptions,
                 entropy_pool: Optional[torch.Tensor]):
        self.logp, self.entropy, self.token_kind = logp, entropy, token_kind.contiguous()
        self.options, self.entropy_pool = options, entropy_pool
        self.loss_tensors = fp32_loss_tensors(inputs)
        self.denominators = tensor_denominators(options)
        self.settings = objective_settings(options, inputs, has_entropy=True)
        num_rows, num_samples = logp.shape[0], inputs.advantages.shape[0]
        self.outputs = SampleOutputs.empty(num_rows, num_samples, logp.device)
        self.finish = FinishOutputs.empty(logp.device)  # kernel 2's, of which the chunks read the global factors
        self.grad_logp, self.grad_entropy = torch.empty_like(logp), torch.empty_like(entropy)
        self.sample_index, self.spans = sample_index.contiguous(), spans
        self.threshold = None  # the entropy filter's, set by `start`
        self.filtered = options.top_entropy_quantile < 1.0
        # without the filter the global factors read counts alone, from token_kind and sample_index: made now (with
        # it, the kept rows' count is known once the pre-pass is written: `start`; with N = 0 no chunk reads them)
        if num_rows and not self.filtered:
            self._global_factors()

    def _global_factors(self) -> None:
        """Kernels 1 and 2 over every sample's span of scored rows on logp and entropy as they hold now, with the
        entropy filter's threshold when set: the global factors in `self.finish.scales`. Kernel 1's other outputs
        are rewritten by each chunk's before they are read."""
        if self.spans is None:
            self.spans = triton_sample_spans(self.sample_index, self.outputs.query_logp.shape[0], self.token_kind)
        launch_sample_kernel(self.outputs, self.logp, self.entropy, self.token_kind, None, self.spans, None,
                             self.loss_tensors, self.threshold, self.settings, sample_index=self.sample_index)
        launch_finish_kernel(self.outputs, *self.denominators, self.settings, results=self.finish)

    def start(self, chunks, host_kind: np.ndarray, host_sample: np.ndarray) -> None:
        """The once-per-call work on the rows' layout (host arrays as `chunk_layout`'s) and the pre-pass values:
        the layout's upload and, with the entropy filter, its threshold and the global factors (kernels 1 and 2
        over every sample)."""
        layout = chunk_layout(chunks, host_kind, host_sample, self.outputs.query_logp.shape[0])
        # the host's work on it before the upload, so that (without the entropy filter) the first chunk's sample
        # kernel follows the upload with only its launch's host work between: the GPU has nothing else queued there
        self.program_offsets = layout.program_offsets.tolist()
        parts = [layout.sample_starts, layout.rows_by_sample, layout.sample_ids]
        sizes = [len(part) for part in parts]
        staged = staging_for(self.logp.device, sum(sizes), torch.int64)  # pinned on CUDA: no second host copy
        np.concatenate(parts, out=staged.numpy())
        uploaded = host_to_device(staged, self.logp.device)
        self.sample_starts, self.rows_by_sample, self.sample_ids = uploaded.split(sizes)
        if self.filtered:
            self.threshold = _entropy_threshold(self.entropy, self.token_kind, self.options, self.entropy_pool)
            self._global_factors()

    def gradient(self, chunk: int, rows: slice):
        first, last = self.program_offsets[chunk], self.program_offsets[chunk + 1]
        launch_sample_kernel(self.outputs, self.logp, self.entropy, self.token_kind, self.rows_by_sample,
                             self.sample_starts, self.sample_ids[first:last], self.loss_tensors, self.threshold,
                             self.settings)
        # d loss / d loss = 1 (grad_loss None): the op's backward scales the stored gradients by the incoming one
        return launch_grad_kernel(None, self.token_kind[rows], self.outputs.coef_logp[rows],
                                  self.outputs.coef_entropy[rows], self.finish.scales,
                                  out=(self.grad_logp[rows], self.grad_entropy[rows]))


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
