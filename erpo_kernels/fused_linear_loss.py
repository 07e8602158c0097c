"""The fused-linear ERPO loss in row chunks at 6NDV: the gradient is formed in the forward, as Liger's chunked losses.

Per chunk c (a row range of at most `Workspace.chunk_rows` rows, `plan_chunks`), then per group g of consecutive
chunks (`GradientGroups`):

    logits_c  = hidden_c @ W.T (+ bias)          one GEMM (cuBLAS on CUDA) with fp32 output into one reused
                                                 [rows, V] fp32 buffer (never rounded to bf16: the Query-KL sums a
                                                 prompt's log-probs, where bf16 logits' 0.01-nat errors add up)
    logp_c, H_c, lse_c                           the per-row softmax pass of the logits path (Triton, or torch)
    g_logp_c, g_H_c = d loss / d (logp_c, H_c)   the backend's chunk objective (`RowKernels.chunk_objective`):
                                                 Triton, the objective's kernels on c's samples alone (two
                                                 launches, triton_chunk_objective.py); torch, the reference
                                                 objective on [N] vectors, differentiated by autograd (the oracle)
    dlogits_c                                    the logits path's backward, in hidden's dtype, written into c's
                                                 rows of the group's dlogits store [G, V] (or, when the budget
                                                 holds more rows so, over the first half of each fp32 logits row,
                                                 `gradient_view`, a group being one chunk)
    dH_g  = dlogits_g @ W                        one GEMM per group, rounded once to hidden's dtype (with
                                                 GRAD_HIDDEN_FP32 in fp32, rounded once by the backward instead)
    dW   += dlogits_g.T @ hidden_g               one GEMM per group accumulated in fp32, the first group writing it
                                                 (rows that get no gradient zeroed first, chunk by chunk into the
                                                 group's [G, D] buffer, so a non-finite padding row cannot poison
                                                 dW)

That is 2NDV + 2NDV + 2NDV. Why groups: each accumulation reads and writes the fp32 [V, D] accumulator (4.4 GB for
Qwen2.5-7B), which on an H200 cost 39.2 ms per 16384 rows in 1024-row passes against 28.4 ms in 2048-row and 25.9
ms in 4096-row ones (bench/gemm_probe.py, 2026-11-26, commit 2ab6bb9), while the logits GEMM runs at the same rate
from 1024 to 4096 rows. A bf16 dlogits row costs half an fp32 logits row, so chunks of LOGITS_ROWS rows beside a
store of whole chunks put more rows in each accumulation than one buffer of chunks whose dlogits lie over their
logits (`plan_workspace`: in 1 GiB, 2048 rows against 1744 for bf16 Qwen2.5-7B). The loss value and metrics are
formed once at the end from the [N] log-probs and entropies by the objective itself (`api.objective_on_backend`);
backward only scales the stored dH / dW / dbias by the incoming gradient (one vectorized pass each,
triton_scale.py). The op makes the call's one host read: the rows' layout for the plan (not when the caller
holds it, as `padded_erpo_loss`'s selection of the scored rows does) with the value checks' code (validate=True);
on CUDA that read waits only for their copy, so the logits GEMM of the first chunk's first half, queued after it,
runs while the host plans, and the host's work before it (the op's dispatch, its setup) runs while the work queued
before the call does. After the plan, the rest of the first chunk's logits and (but with the entropy filter, whose
setup reads the pre-passed entropies that it would replace) its forward row kernel are queued before the host work
that feeds neither (the groups' buffers, the objective's setup on the layout: `chunk_layout`, its staging buffer),
so the GPU runs them while the host does that work; the layout's upload then comes last (but with the entropy
filter, whose threshold and global factors follow it), right before the first chunk's sample kernel that reads it.
What the GPU still waits for there is the host's work beyond those queued kernels (the plan beyond half a chunk's
GEMM, the layout and the first chunk's launches beyond the rest of it): the read cannot come earlier (it waits for
the value checks' code, and on CUDA for all that was queued before the call), and with one logits buffer nothing
else is free of the plan, so only less host work there, or the caller's layout, shortens it (bench/RESULTS.md, "Host
order of the default fused call (CPU)"). When the caller holds the layout, the plan, the pre-pass and the whole
first chunk's logits and forward row kernel come before the wait for the checks' code, and so does the objective's
setup on the layout: the chunk loop follows the read at once. (The objective's global factors, which read counts
alone, are queued before the read either way; with the entropy filter, whose kept rows they count on the pre-pass,
as part of that setup.)

Why chunk c's gradient is exact: d loss / d logp_t depends on other rows only through (a) counts known from
token_kind alone (num_items, the response-sample and query-sample counts, which stay separate), (b) per-sample
values (ell_theta(q) for the Query-KL, read by the sample's query rows; the sequence-level ratio, VESPO's weight, the
off-policy mask, read by its response rows) and (c) the entropy filter's batch-wide quantile and kept-row count. The
chunk objectives read [N] vectors that hold each pre-passed row's value, then each chunk's own rows once formed: (a)
the Triton one forms its global factors once from counts (one pass over every sample's span before the chunks:
before the op's host read, nothing there needing the layout on the host, but with the entropy filter, whose kept
rows it counts on the pre-pass values), the torch one holds every row; (b) holds because the chunks keep a sample's
query rows, and its response rows, together where they can (`plan_chunks`; its query rows and its response rows may
lie in different chunks, no row reading the other kind's value); a set a cut splits (longer than half a chunk, or
interleaved rows) and (c) get their coupled rows from a forward-only pre-pass (2 D V FLOPs per pre-passed row):
the split query rows when the Query-KL needs ell_theta(q), the split response rows when a per-sample response value
is read, and every response row with the entropy filter (its threshold, and the kept-row count of the token-mean
entropy bonus).

Launches: a constant, 6 per chunk and 2 per group on the Triton backend, 2 more per group with a bias (per chunk
the logits GEMM, the forward row kernel writing straight into the call's [N] vectors, the objective's two, the
backward row kernel and the hidden rows that d weight reads, `triton_gradient_rows`; per group d hidden and
d weight, d bias's column sum and its addition, the first group's written instead: 13 + 6 x chunks + 4 x groups
with an fp32 bias and validate=False, counted on the CPU, tests/kernels/test_fused_linear_loss.py; a bf16 / fp16
bias adds one, its cast to fp32 where the call's `LogitsBuffer` is made (a buffer per call, and one more when the
entropy filter's pool is gathered first), on CUDA too, none with EPILOGUE_ROW_PASS; per call and per chunk, with the
host's microseconds, `python -m bench.host_cost --path fused`). No host read inside the chunk
loop but fp16's gradient scale (one per chunk). The torch backend, the oracle, runs the whole reference objective
with autograd per chunk (O(N) work and all its ops each time).

With EPILOGUE_ROW_PASS (private, off by default until a GPU lease times it: issue 32) the Triton backend forms
logits_c and (logp_c, H_c, lse_c) in one Triton GEMM whose epilogue writes each (row, vocabulary tile)'s softmax
statistics beside the fp32 logits, then one small kernel merging them per row (triton_logits_gemm.py,
`LogitsBuffer.row_values`): the same launches, the row pass's read of the chunk's logits saved, the same buffer
holding the same raw logits for the backward row kernel (the statistics' side buffer, 12 bytes per row and
vocabulary tile, is counted in the workspace).

A pipelined chunk loop (chunk c's row kernels on a side stream beside chunk c + 1's logits GEMM, in a second fp32
logits buffer, optionally under a cuBLASLt SM carveout) was built and measured: on an H200 it lost on both shapes
at 1 and 2 GiB (Qwen2.5-7B, N = 16384: 107.1 ms against the serial loop's 93.2), since the row passes did not
overlap a GEMM on a second stream and the second buffer halved the groups (bench/RESULTS.md, the H200 lease of
2026-11-27). It was dropped; the serial loop above is the only one.

Memory beyond the inputs: at most `workspace_bytes` for the chunk buffers (never [N, V]): the fp32 logits buffer and
the row pass's temporaries, the dlogits store and the group's masked hidden rows (`plan_workspace`). Outside it, as
docs/API.md states: the fp32 d weight accumulator [V, D] (4 V D bytes, none for an fp32 weight, whose gradient it
is): like the fp32 gradient an optimizer keeps, its size is fixed by the lm_head and does not grow with N; d bias
[V] fp32 (and, while the logits are formed, a bf16 / fp16 bias's fp32 copy [V]); the gradients d hidden [N, D],
d weight [V, D], d bias [V] in the inputs' dtypes, held from the forward to the backward (d hidden in fp32 with
GRAD_HIDDEN_FP32: 4 N D bytes instead of 2 N D for bf16 / fp16 inputs, rounded into a copy of hidden's dtype by the
backward's scale pass); O(N) vectors.
"""
from __future__ import annotations

import ast
import bisect
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np
import torch

from .api import segment_sum_of
from .common import host_to_device, index_slices, rows_receiving_gradient
from .objective import erpo_objective
from .torch_fused_linear import torch_rows_forward, torch_rows_gradient
from .validation import OPTION_NAMES, LogitTransform, LossInputs, LossOptions, read_later, rows_passed

DEFAULT_WORKSPACE_BYTES = 1 << 30  # the chunk buffers' budget (1 GiB)
# fp32 temporaries per logit that the torch row pass makes on top of the buffer (z, p and their products)
TORCH_ROW_TEMPORARY_BYTES = 32


@dataclass(frozen=True)
class RowKernels:
    """One backend's work on a chunk: the per-row softmax pass on fp32 logits [n, V] (the logits path's kernels)
    and the objective's gradient on the chunk's rows.

    forward(logits, targets [n] int64 -100 = ignored, LogitTransform, out) -> (logp, entropy, lse) [n] fp32, written
        into out (three contiguous [n] fp32 tensors: views of the call's [N] vectors, so nothing is copied after)
    backward_into(grad_logits, logits, targets, lse, entropy, grad_logp, grad_entropy, LogitTransform): writes d logits
        into grad_logits [n, V] (any float dtype; it may alias `logits` row by row, see `gradient_view`)
    gradient_rows_into(out, hidden_rows, targets, grad_logp, grad_entropy): writes hidden_rows [n, D] into out
        [n, D], the rows that receive no gradient zeroed (`common.rows_receiving_gradient`): d weight's operand
    temporary_bytes_per_logit: what the pass allocates per logit beyond the buffer (for the workspace budget)
    chunk_objective(ChunkObjectiveInputs) -> an object made before the call's host read whose
        start(chunks, host_kind, host_sample) takes the plan's chunks and the host [N] token_kind and sample_index
        once the pre-pass values are written, and whose gradient(c, rows: slice) then gives
        (d loss / d logp, d loss / d entropy) [n] fp32 on chunk c's rows
    zero_fill(first, second, third): writes zeros into three contiguous fp32 tensors (Triton: one launch)
    """

    name: str
    forward: Callable
    backward_into: Callable
    gradient_rows_into: Callable
    temporary_bytes_per_logit: int
    chunk_objective: Callable
    zero_fill: Callable


@dataclass(frozen=True)
class ChunkObjectiveInputs:
    """What a chunk's objective gradient reads besides the rows' layout (`start`'s). logp, entropy [N] fp32: the rows'
    values as the chunks go (the pre-pass values at first, each chunk's own written before its gradient is asked);
    token_kind, sample_index [N]; spans [2, S] int64: each sample's span of scored rows when the value checks or the
    spans kernel found them before the op (`triton_segment.sample_spans`' form), else None; inputs, options
    validated; segment_sum: the backend's per-sample sums; entropy_pool: the entropy filter's pool gathered across
    processes (top_entropy_gather), or None."""

    logp: torch.Tensor
    entropy: torch.Tensor
    token_kind: torch.Tensor
    sample_index: torch.Tensor
    spans: Optional[torch.Tensor]
    inputs: LossInputs
    options: LossOptions
    segment_sum: Callable
    entropy_pool: Optional[torch.Tensor]


# The chunks' forward kernel walks each row with 8 warps (the base-2 loop in 4096-wide steps): a chunk holds few
# rows (512 fp32 rows for bf16 Qwen2.5-7B in 1 GiB), and the logits path's one warp per row leaves an H200's SMs
# about 4 warps each there. `python -m bench.row_kernel_probe` on one H200 (2026-11-26, commit 90e1330, V=152064,
# fp32), ms per launch: 512 rows 0.089 (log2-1024: 0.154), 1024 rows 0.187 (log2-1024: 0.183). One variant for
# every chunk keeps a row's values independent of the chunk it lands in.
CHUNK_FORWARD_VARIANT = "log2-block"


def _triton_forward(logits, targets, transform: LogitTransform, out):
    # the logits path's launcher (inside this op's body no op boundary is needed), with the chunks' own variant
    from .triton_logits import _launch_forward
    return _launch_forward(logits, targets, transform, CHUNK_FORWARD_VARIANT, out)


def _torch_forward(logits, targets, transform: LogitTransform, out):
    for into, value in zip(out, torch_rows_forward(logits, targets, transform)):
        into.copy_(value)
    return out


def _triton_backward_into(grad_logits, logits, targets, lse, entropy, grad_logp, grad_entropy,
                          transform: LogitTransform):
    # The logits path's backward launcher (inside this op's body no op boundary is needed): one program per row,
    # each vocabulary block loaded before its gradient is stored, so an output aliasing the row's first half is safe.
    from .triton_logits import _launch_backward
    _launch_backward(grad_logits, logits, targets, lse, entropy, grad_logp, grad_entropy, transform,
                     variant_name=CHUNK_FORWARD_VARIANT)  # the backward that goes with the chunks' forward


def _torch_backward_into(grad_logits, logits, targets, lse, entropy, grad_logp, grad_entropy,
                         transform: LogitTransform):
    grad_logits.copy_(torch_rows_gradient(logits, targets, lse, entropy, grad_logp, grad_entropy, transform))


def _triton_gradient_rows_into(out, hidden_rows, targets, grad_logp, grad_entropy):
    from .triton_gradient_rows import gradient_rows_into  # Triton is imported only when its kernels run
    gradient_rows_into(out, hidden_rows, targets, grad_logp, grad_entropy)


def _torch_gradient_rows_into(out, hidden_rows, targets, grad_logp, grad_entropy):
    out.copy_(torch.where(rows_receiving_gradient(targets, grad_logp, grad_entropy).unsqueeze(1), hidden_rows, 0.0))


def _triton_zero_fill(first, second, third):
    from .triton_fill import zero_fill  # Triton is imported only when its kernels run
    zero_fill(first, second, third)


def _torch_zero_fill(first, second, third):
    for tensor in (first, second, third):
        tensor.zero_()


def logits_row_bytes(vocab_size: int, kernels: RowKernels, stats_bytes: int = 0) -> int:
    """Workspace bytes of one row of the fp32 logits buffer: 4 V, plus the row pass's temporaries, plus
    `stats_bytes`, its row of the epilogue's statistics (EPILOGUE_ROW_PASS: `triton_logits_gemm.stats_row_bytes`)."""
    return vocab_size * (4 + kernels.temporary_bytes_per_logit) + stats_bytes


def gradient_row_bytes(vocab_size: int, hidden_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """Workspace bytes of one group row besides its dlogits: its masked hidden row [D] and, off CUDA, the fp32
    copies of its dlogits and hidden rows that the d weight GEMM upcasts (CUDA multiplies bf16 / fp16 operands into
    fp32 inside the GEMM)."""
    item = dtype.itemsize
    upcast = 0 if device.type == "cuda" or dtype == torch.float32 else 4
    return vocab_size * upcast + hidden_dim * (item + upcast)


# Rows of a chunk when the dlogits have a store of their own: the logits GEMM [LOGITS_ROWS, D] x [D, V] is still
# compute-bound (2 LOGITS_ROWS FLOPs per byte of the weight it reads) and leaves most of the budget to the store.
LOGITS_ROWS = 512
# A cap on the store's rows (None: none), the probe's knob for the group's geometry (bench.fused_probe sets it, as
# it does LOGITS_ROWS; not public API). When set, the plan is chunks of LOGITS_ROWS rows beside a store of at most
# GROUP_ROWS rows, whole chunks, whenever the budget holds one chunk there, even where the dlogits over the logits
# would hold more rows: the d hidden GEMM's shape [G, V] x [V, D] is what a variant measures.
GROUP_ROWS = None
# d hidden's dtype from the forward to the backward, for bf16 / fp16 inputs (fp32 ones get fp32 either way): False,
# hidden's own: each group's d hidden GEMM writes it (rounded there, where cuBLAS may also add a split-K GEMM's partial
# sums in bf16 while torch's allow_bf16_reduced_precision_reduction is True, its default), and the backward's scale
# pass rounds it again unless the incoming gradient is 1 (a trainer's loss / accumulation steps is not); True, fp32:
# the GEMM's fp32 output, as the logits' and d weight's, rounded once to hidden's dtype by the backward's scale pass
# (fused_linear_token_logprobs' backward: once at its end), for 2 N D bytes more held from the forward to the
# backward (117 MB for Qwen2.5-7B, D = 3584, at N = 16384) and as many more written and read. Read where used, so
# the bench sets it for a block of calls (its contender erpo-dh32, bench.geometry.fused_constants; not public API).
# False until a GPU lease measures what True costs (issue 32; bench/README.md says how the next session decides).
GRAD_HIDDEN_FP32 = False
# Where the loss's chunks get their rows' (logp, entropy, lse) on the Triton backend: False, cuBLAS writes each chunk's
# fp32 logits (`_write_logits`) and the forward row kernel reads them back (`RowKernels.forward`); True, a Triton GEMM
# writes them with each (row, vocabulary tile)'s softmax statistics in its epilogue, and a small kernel merges those
# (erpo_kernels/triton_logits_gemm.py, `EpilogueRowPass`): the row pass's read of the logits saved (10 GB per 16384
# rows at Qwen2.5-7B), if a Triton GEMM runs near cuBLAS's speed (issue 32). The same buffer holds the same raw fp32
# logits (the bias added) for the backward row kernel; the backward, the dlogits store and the d hidden / d weight
# GEMMs are unchanged; so are the launches (one GEMM and one row kernel a chunk) and the host reads. It covers what
# the loss does on that path: every logit transform, a bias, bf16 / fp16 / fp32 inputs (fp32 without TF32), -100
# targets, the pre-pass rows and the entropy filter's pool, batch_invariant (its padded GEMMs of INVARIANT_ROWS rows,
# kept: a row of this GEMM does not depend on the rows beside it, so the padding is not needed there, but the
# option does not change what batch_invariant does). The torch backend, the oracle, keeps cuBLAS and its row pass,
# whatever this says; `fused_linear_token_logprobs` (token_forward / token_backward) follows it, so that a
# trainer's scored rows (ell_theta0(q) at theta0 among them: its Query-KL exactly 0 there) are the loss's bits. Read
# where used, so the bench sets it for a block of calls (its contender erpo-epi, bench.geometry.fused_constants; not
# public API).
# False until a GPU lease measures it (bench/README.md, "Deciding the epilogue row pass").
EPILOGUE_ROW_PASS = False


def epilogue_row_pass(kernels: RowKernels) -> bool:
    """Whether the loss's logits GEMMs form the forward row pass in their epilogue: EPILOGUE_ROW_PASS on the Triton
    backend (the torch backend, the oracle, keeps cuBLAS and its row pass)."""
    return EPILOGUE_ROW_PASS and kernels.name == "triton"


def _epilogue_stats_bytes(vocab_size: int, dtype: torch.dtype) -> int:
    from .triton_logits_gemm import stats_row_bytes  # Triton is imported only when its kernels run
    return stats_row_bytes(vocab_size, dtype)


def grad_hidden_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype d hidden is formed and held in for inputs of `dtype`: fp32 when GRAD_HIDDEN_FP32, else `dtype`."""
    return torch.float32 if GRAD_HIDDEN_FP32 else dtype


@dataclass(frozen=True)
class Workspace:
    """How `workspace_bytes` is spent. chunk_rows: rows of the fp32 logits buffer (a chunk's rows at most);
    group_rows: rows whose dlogits are held until one d hidden GEMM and one d weight accumulation serve them all;
    separate_store: the dlogits go into a [group_rows, V] store of the inputs' dtype (else over each chunk's own
    logits, `gradient_view`: a group is one chunk, group_rows == chunk_rows)."""

    chunk_rows: int
    group_rows: int
    separate_store: bool


def plan_workspace(num_rows: int, hidden_dim: int, vocab_size: int, dtype: torch.dtype, device: torch.device,
                   kernels: RowKernels, workspace_bytes: int, batch_invariant: bool,
                   epilogue: bool = False) -> Workspace:
    """The `Workspace` that gives the most rows per d weight accumulation within `workspace_bytes`: the dlogits over
    the logits (a row costs `logits_row_bytes`, with its row of statistics when `epilogue`, + `gradient_row_bytes`),
    or, when that holds fewer rows, chunks of LOGITS_ROWS rows beside a store of whole chunks (a store row costs V
    items + `gradient_row_bytes`; at most GROUP_ROWS rows when set, and then the store whenever it holds a chunk).
    Each count at least 1 and at most N; with batch_invariant the chunk rows are a multiple of INVARIANT_ROWS (at
    least one)."""
    item = dtype.itemsize
    logits_row = logits_row_bytes(vocab_size, kernels, _epilogue_stats_bytes(vocab_size, dtype) if epilogue else 0)
    gradient_row = gradient_row_bytes(vocab_size, hidden_dim, dtype, device)
    rows = max(num_rows, 1)
    in_place = min(rows, max(1, workspace_bytes // (logits_row + gradient_row)))
    chunk = _invariant_rows(min(LOGITS_ROWS, rows), batch_invariant)
    group = min(rows, (workspace_bytes - chunk * logits_row) // (vocab_size * item + gradient_row))
    group = (group if GROUP_ROWS is None else min(group, GROUP_ROWS)) // chunk * chunk
    if group > in_place or (GROUP_ROWS is not None and group > 0):
        return Workspace(chunk, group, True)
    in_place = _invariant_rows(in_place, batch_invariant)
    return Workspace(in_place, in_place, False)


def _invariant_rows(rows: int, batch_invariant: bool) -> int:
    """rows, or with batch_invariant the multiple of INVARIANT_ROWS below it (at least INVARIANT_ROWS)."""
    return max(INVARIANT_ROWS, _invariant_floor(rows, batch_invariant)) if batch_invariant else rows


def _invariant_floor(rows: int, batch_invariant: bool) -> int:
    """rows, or with batch_invariant the multiple of INVARIANT_ROWS below it (0 included)."""
    return rows // INVARIANT_ROWS * INVARIANT_ROWS if batch_invariant else rows


@dataclass(frozen=True)
class ChunkPlan:
    """chunks: consecutive (start, stop) row ranges covering [0, N); prepass_rows: int64 [P] rows whose logp and
    entropy a chunk's gradient needs from outside the chunk (sorted)."""

    chunks: list
    prepass_rows: np.ndarray


def plan_chunks(token_kind: np.ndarray, sample_index: np.ndarray, num_samples: int, max_rows: int, *,
                query_sums: bool, response_values: bool, all_response_entropies: bool) -> ChunkPlan:
    """Cut [0, N) into chunks of at most `max_rows` rows and list the pre-pass rows. token_kind, sample_index: host
    [N] integer arrays.

    A per-sample value that a gradient reads couples a sample's rows of one kind: its query rows when `query_sums`
    (the Query-KL reads ell_theta(q)), its response rows when `response_values` (sequence-level ratio, VESPO, the
    off-policy mask). Nothing else couples rows across chunks: a query row's gradient reads no response value and a
    response row's no query value, so a sample's query and response rows may lie in different chunks. Each chunk
    ends at the last place that splits no coupled set when that leaves the chunk at least half full, else at
    `max_rows`; a coupled set that a cut splits is pre-passed, and with `all_response_entropies` (the entropy
    filter) every response row is."""
    num_rows = len(token_kind)
    coupled = [kind for kind, reads in ((1, query_sums), (2, response_values and not all_response_entropies))
               if reads]
    rows_of = {kind: np.flatnonzero(token_kind == kind) for kind in coupled}
    spans = {kind: _sample_spans(rows_of[kind], sample_index, num_samples, num_rows) for kind in coupled}
    # O(S) work from here on, but for the pre-pass rows' list when a set is split (host time between the call's read
    # and the first chunk's GEMM: no more passes over the N rows than finding each kind's)
    forbidden_lo, forbidden_hi = _forbidden_cuts(spans.values())
    chunks, start = [], 0
    while start < num_rows:
        stop = min(start + max_rows, num_rows)
        if stop < num_rows:
            k = bisect.bisect_right(forbidden_lo, stop) - 1
            free = forbidden_lo[k] - 1 if k >= 0 and stop <= forbidden_hi[k] else stop  # the last free cut <= stop
            if free - start >= (stop - start) / 2:  # else a set longer than the rest of the chunk is split
                stop = free                          # (cheaper than a thin GEMM)
        chunks.append((start, stop))
        start = stop
    cuts = np.array([stop for _, stop in chunks[:-1]], dtype=np.int64)
    needed = token_kind == 2 if all_response_entropies else None
    for kind, (first, last) in spans.items():
        # a cut c splits a set whose rows run from first to last when first < c <= last
        split = (last >= 0) & (np.searchsorted(cuts, last, side="right") > np.searchsorted(cuts, first, side="right"))
        if split.any():
            rows = rows_of[kind]
            needed = np.zeros(num_rows, dtype=bool) if needed is None else needed
            needed[rows] |= split[sample_index[rows]]
    return ChunkPlan(chunks, np.zeros(0, dtype=np.int64) if needed is None else np.flatnonzero(needed))


def _forbidden_cuts(spans) -> Tuple[list, list]:
    """(lo, hi): the cuts that split a coupled set, as disjoint ranges lo[k] <= c <= hi[k], ascending, with at least
    one free cut between two ranges; spans: (first, last) int64 [S] pairs (`_sample_spans`). A cut at row c (between
    rows c - 1 and c) splits the set whose rows run from first to last when first < c <= last."""
    firsts, lasts = [], []
    for first, last in spans:
        spread = (last >= 0) & (first < last)
        firsts.append(first[spread] + 1)
        lasts.append(last[spread])
    lo = np.concatenate(firsts) if firsts else np.zeros(0, dtype=np.int64)
    if lo.size == 0:
        return [], []
    order = np.argsort(lo, kind="stable")
    lo, reach = lo[order], np.maximum.accumulate(np.concatenate(lasts)[order])
    opens = np.ones(lo.shape[0], dtype=bool)  # a range opens where a set begins beyond every earlier one's reach
    np.greater(lo[1:], reach[:-1] + 1, out=opens[1:])
    closes = np.append(opens[1:], True)
    return lo[opens].tolist(), reach[closes].tolist()


def _sample_spans(rows: np.ndarray, sample_index: np.ndarray, num_samples: int, num_rows: int):
    """(first, last) int64 [S]: each sample's first and last row among `rows` (ascending row numbers; N and -1 for
    a sample without one). Samples in consecutive rows (their ids ascending along `rows`) take one pass over their
    boundaries; interleaved ones a scatter of the minimum and the maximum."""
    samples = sample_index[rows]
    first = np.full(num_samples, num_rows, dtype=np.int64)
    last = np.full(num_samples, -1, dtype=np.int64)
    if samples.size and bool(np.all(samples[1:] >= samples[:-1])):
        begins = np.flatnonzero(samples[1:] != samples[:-1]) + 1  # each sample's run of rows, one run a sample
        ids = samples[np.append(0, begins)]
        first[ids] = rows[np.append(0, begins)]
        last[ids] = rows[np.append(begins - 1, rows.shape[0] - 1)]
    else:
        np.minimum.at(first, samples, rows)
        np.maximum.at(last, samples, rows)
    return first, last


def cpu_fp32_operand(tensor):
    """tensor [any shape] in fp32: off CUDA, the copy of a bf16 / fp16 GEMM operand that CUDA's GEMMs with fp32
    output (`out_dtype`) do without, inside the GEMM. Its own function so that tests/support/launch_counts.py can
    leave these CPU-only copies out of its launch counts (CUDA makes none)."""
    return tensor.float()


def _write_logits(out, hidden_rows, weight, bias):
    """out [n, V] fp32 := hidden_rows @ weight.T (+ bias [V] fp32, or None): one GEMM with fp32 output (on CUDA the
    bf16 / fp16 operands' products summed in fp32 and never rounded to their dtype; elsewhere in fp32), the bias in
    its epilogue. The caller casts a bf16 / fp16 bias to fp32 once (`LogitsBuffer`), not this once per GEMM."""
    if hidden_rows.dtype == torch.float32:
        operands = (hidden_rows, weight.t())
        extra = {}
    elif out.is_cuda:
        operands = (hidden_rows, weight.t())
        extra = {"out_dtype": torch.float32}
    else:
        operands = (cpu_fp32_operand(hidden_rows), cpu_fp32_operand(weight).t())
        extra = {}
    if bias is None:
        torch.mm(*operands, out=out, **extra)
    else:
        torch.addmm(bias, *operands, out=out, **extra)


def gradient_view(logits, dtype):
    """Where the chunk's dlogits go: the fp32 logits [n, V] themselves for fp32 inputs; else a [n, V] view of dtype
    (row stride 2 V) on the first half of each fp32 logits row, so no second buffer is needed. Writing entry j of a
    row overwrites fp32 entry j // 2 <= j of the same row, which a row pass that reads each vocabulary block before
    it stores that block's gradient (both row kernels; blocks in ascending order) has already read."""
    if dtype == torch.float32:
        return logits
    return logits.view(dtype)[:, :logits.shape[1]]


INVARIANT_ROWS = 256  # batch_invariant=True: every logits GEMM is [INVARIANT_ROWS, D] x [D, V]


class LogitsBuffer:
    """The one [rows, V] fp32 buffer the chunks' logits are formed in, rows >= `max_rows`, and the forward row pass on
    its rows (`row_values`): `kernels`' row kernel under `transform` on the logits, or with `epilogue` the merge of
    the statistics that the Triton GEMM formed beside them (EPILOGUE_ROW_PASS, `triton_logits_gemm.EpilogueRowPass`:
    then the logits GEMMs are that GEMM's, not cuBLAS's).

    cuBLAS chooses its kernel, and with it the order of each dot product's summation, by the GEMM's shape, so a
    row's logits can differ in the last bits with the number of rows it is multiplied with. With batch_invariant
    every GEMM has INVARIANT_ROWS rows (a chunk's last piece zero-padded in a staging copy): a row's logits, and so
    its log-prob and entropy, then do not depend on the rest of the batch. Cost: the padded rows' FLOPs (under
    INVARIANT_ROWS per chunk; a batch of fewer rows still pays INVARIANT_ROWS) and GEMMs of INVARIANT_ROWS rows.
    """

    def __init__(self, max_rows: int, hidden, weight, bias, batch_invariant: bool, kernels: RowKernels,
                 transform: LogitTransform, epilogue: bool = False):
        self.weight, self.batch_invariant = weight, batch_invariant
        # cuBLAS's addmm adds a bias of its output's dtype: a bf16 / fp16 one is cast to fp32 here, once for all the
        # buffer's GEMMs (the same fp32 values each time); the epilogue's GEMM reads it as it is (fp32 in the kernel)
        self.bias = bias if bias is None or epilogue else bias.float()
        self.kernels, self.transform = kernels, transform
        rows = -(-max_rows // INVARIANT_ROWS) * INVARIANT_ROWS if batch_invariant else max_rows
        self.buffer = hidden.new_empty(rows, weight.shape[0], dtype=torch.float32)
        self.staging = hidden.new_empty(INVARIANT_ROWS, hidden.shape[1]) if batch_invariant else None
        self.epilogue = None
        if epilogue:
            from .triton_logits_gemm import EpilogueRowPass  # Triton is imported only when its kernels run
            self.epilogue = EpilogueRowPass(rows, hidden, weight, bias, transform)

    def formed(self, num_rows: int):
        """[num_rows, V] fp32 view of the buffer's first rows, as earlier `logits` calls left them."""
        return self.buffer[:num_rows]

    def logits(self, hidden_rows, first: int = 0):
        """[first + n, V] fp32 view of the buffer's first rows, rows first to first + n now holding hidden_rows
        [n, D] @ weight.T (+ bias) (rows before `first` as an earlier call left them; with batch_invariant and n > 0
        `first` is a multiple of INVARIANT_ROWS). No GEMM when n = 0."""
        num_rows = hidden_rows.shape[0]
        if not self.batch_invariant:
            if num_rows:
                self._write(first, hidden_rows)
            return self.buffer[:first + num_rows]
        for start in range(0, num_rows, INVARIANT_ROWS):
            piece = hidden_rows[start:start + INVARIANT_ROWS]
            if piece.shape[0] < INVARIANT_ROWS:
                self.staging[:piece.shape[0]] = piece
                self.staging[piece.shape[0]:] = 0
                piece = self.staging
            self._write(first + start, piece)
        return self.buffer[:first + num_rows]

    def _write(self, first: int, hidden_rows) -> None:
        """Rows first to first + n of the buffer := hidden_rows [n, D] @ weight.T (+ bias): one GEMM, cuBLAS's or
        the epilogue's (which also writes the same rows of its statistics). Every logits GEMM of the loss goes
        through here, whichever forms it: `python -m bench.host_cost --path fused` records each call as one."""
        out = self.buffer[first:first + hidden_rows.shape[0]]
        if self.epilogue is None:
            _write_logits(out, hidden_rows, self.weight, self.bias)
        else:
            self.epilogue.write(out, hidden_rows, first)

    def row_values(self, num_rows: int, targets, out):
        """(logp, entropy, lse) [num_rows] fp32 of the buffer's first num_rows rows as `logits` formed them (targets
        [num_rows] int64, -100 = ignored), written into out (three contiguous [num_rows] fp32 tensors) and
        returned: the forward row kernel on the logits, or with the epilogue the merge of their statistics."""
        if self.epilogue is None:
            return self.kernels.forward(self.formed(num_rows), targets, self.transform, out)
        return self.epilogue.row_values(self.formed(num_rows), targets, out)


def _accumulate_product(accumulator, a, b, alpha: float = 1.0, accumulate: bool = True):
    """accumulator [m, k] fp32 (+)= alpha * a [m, n] @ b [n, k], added when `accumulate`, else written (beta = 0: the
    old contents, even NaN, are not read): on CUDA one GEMM with fp32 output (cuBLAS adds the fp32 product of bf16 /
    fp16 operands to the accumulator, no rounding to the operands' dtype); elsewhere in fp32."""
    beta = 1.0 if accumulate else 0.0
    if a.dtype == accumulator.dtype:
        accumulator.addmm_(a, b, beta=beta, alpha=alpha)
    elif accumulator.is_cuda:
        torch.addmm(accumulator, a, b, beta=beta, alpha=alpha, out_dtype=torch.float32, out=accumulator)
    else:
        accumulator.addmm_(cpu_fp32_operand(a), cpu_fp32_operand(b), beta=beta, alpha=alpha)


def write_grad_hidden(out, dlogits, weight, alpha: float = 1.0) -> None:
    """out [G, D] := alpha * dlogits [G, V] @ weight [V, D] (beta = 0: out's old contents, even NaN, are not read), a
    group's d hidden: one GEMM with output in out's dtype, hidden's own (rounded by the GEMM) or fp32
    (GRAD_HIDDEN_FP32: `_accumulate_product`'s fp32 output from bf16 / fp16 operands)."""
    if out.dtype == dlogits.dtype:
        torch.addmm(out, dlogits, weight, beta=0, alpha=alpha, out=out)
    else:
        _accumulate_product(out, dlogits, weight, alpha, accumulate=False)


def _fp16_gradient_scale(grad_logp, grad_entropy) -> float:
    """A power of two s with s * max |grad| in [1, 2) (1 when all are 0 or one is not finite). fp16 dlogits,
    g p_j / T, fall below fp16's smallest subnormal (6e-8) for a token-mean's g ~ 1 / N and p_j ~ 1 / V: the
    chunk's dlogits are written times s, and the GEMMs that read them multiply by 1 / s in fp32 (one host sync)."""
    peak = float(torch.maximum(grad_logp.abs().max(), grad_entropy.abs().max())) if grad_logp.numel() else 0.0
    return 2.0 ** -math.floor(math.log2(peak)) if 0 < peak < math.inf else 1.0


def logp_entropy_of_rows(hidden, targets, rows: torch.Tensor, max_rows: int, logits_buffer: LogitsBuffer):
    """Forward only: (logp, entropy) [P] fp32 of the P rows `rows` (int64 [P] on hidden's device) in pieces of
    `max_rows` rows through `logits_buffer` (its row pass and transform)."""
    logp, entropy, lse = (torch.empty(rows.shape[0], dtype=torch.float32, device=hidden.device) for _ in range(3))
    for piece in index_slices(rows.shape[0], max_rows):
        index = rows[piece]
        logits_buffer.logits(hidden.index_select(0, index))
        logits_buffer.row_values(index.shape[0], targets.index_select(0, index),
                                 (logp[piece], entropy[piece], lse[piece]))
    return logp, entropy


def workspace_of(num_rows: int, hidden, weight, kernels: RowKernels, workspace_bytes: int,
                 batch_invariant: bool, epilogue: bool = False) -> Workspace:
    """`plan_workspace` for N rows of `hidden` [N, D] against `weight` [V, D]."""
    return plan_workspace(num_rows, hidden.shape[1], weight.shape[0], hidden.dtype, hidden.device, kernels,
                          workspace_bytes, batch_invariant, epilogue)


def response_entropies(hidden, weight, bias, targets, token_kind, transform: LogitTransform, kernels: RowKernels,
                       workspace_bytes: int, batch_invariant: bool) -> torch.Tensor:
    """Forward only: entropy [n] fp32 of the n response rows (token_kind == 2), in row order (the entropy filter's
    pool, before a caller's top_entropy_gather)."""
    rows = (token_kind == 2).nonzero().squeeze(1)
    epilogue = epilogue_row_pass(kernels)
    max_rows = workspace_of(rows.shape[0], hidden, weight, kernels, workspace_bytes, batch_invariant,
                            epilogue).chunk_rows
    logits_buffer = LogitsBuffer(max_rows, hidden, weight, bias, batch_invariant, kernels, transform, epilogue)
    return logp_entropy_of_rows(hidden, targets, rows, max_rows, logits_buffer)[1]


# The body of a torch.library op runs with autograd's dispatch keys excluded (below autograd): a tensor made there
# never records a graph, whatever the grad mode. The torch backend's chunk gradient is taken with autograd
# nonetheless (the oracle), so these keys are put back for that one computation (torch.func.grad would work too, but
# not under an outer TorchDispatchMode). The Triton backend needs none of this (triton_chunk_objective.py).
# Called from a TorchDispatchMode's __torch_dispatch__ (the Python fallback excludes every key above Python) by a
# mode that re-enters itself to see inside the op (tests/support/launch_counts.py), the body also runs with the
# PythonTLSSnapshot key excluded and the mode's Python key included; that key is put back too. On CUDA autograd runs
# the gradient's backward on its device thread, which takes these key sets and the mode but not the snapshot that
# the Python fallback reads (a thread-local of its own, set by the PythonTLSSnapshot key): without the key, torch
# 2.11 asserted there (`tls_on_entry.has_value()`, PythonFallbackKernel.cpp; the H100 run of 2026-11-26).
_KEYS_PUT_BACK = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot))


class ReferenceChunkObjective:
    """The torch backend's chunk gradient, the oracle: the reference objective (objective.py) on the [N] vectors,
    chunk c's rows made leaves, differentiated by autograd (O(N) work per chunk)."""

    def __init__(self, given: ChunkObjectiveInputs):
        self.given = given

    def start(self, chunks, host_kind: np.ndarray, host_sample: np.ndarray) -> None:
        """Nothing: the reference objective reads every row each chunk, whatever the layout."""

    def gradient(self, chunk: int, rows: slice):
        """(d loss / d logp, d loss / d entropy) [n] fp32 on chunk `chunk`'s rows `rows`."""
        g = self.given
        exclude = torch._C._dispatch_tls_local_exclude_set() - _KEYS_PUT_BACK
        with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
                torch.enable_grad():
            logp = g.logp[rows].detach().requires_grad_(True)
            entropy = g.entropy[rows].detach().requires_grad_(True)
            loss = erpo_objective(torch.cat((g.logp[:rows.start], logp, g.logp[rows.stop:])),
                                  torch.cat((g.entropy[:rows.start], entropy, g.entropy[rows.stop:])),
                                  g.token_kind, g.sample_index, inputs=g.inputs, options=g.options,
                                  segment_sum=g.segment_sum).loss
            if not loss.requires_grad:  # no term reads these rows
                return torch.zeros_like(logp), torch.zeros_like(entropy)
            return torch.autograd.grad(loss, (logp, entropy), allow_unused=True, materialize_grads=True)


def _triton_chunk_objective(given: ChunkObjectiveInputs):
    from .triton_chunk_objective import TritonChunkObjective  # Triton is imported only when its kernels run
    return TritonChunkObjective(given.logp, given.entropy, given.token_kind, given.sample_index, given.spans,
                                given.inputs, given.options, given.entropy_pool)


ROW_KERNELS = {"triton": RowKernels("triton", _triton_forward, _triton_backward_into, _triton_gradient_rows_into, 0,
                                    _triton_chunk_objective, _triton_zero_fill),
               "torch": RowKernels("torch", _torch_forward, _torch_backward_into, _torch_gradient_rows_into,
                                   TORCH_ROW_TEMPORARY_BYTES, ReferenceChunkObjective, _torch_zero_fill)}


class GradientGroups:
    """The backward half of the chunks: each chunk's dlogits (d loss / d logits, hidden's dtype) written into its
    group's rows of the store, then once per group of consecutive chunks d hidden [G, D] := dlogits @ W, the fp32
    d weight [V, D] += dlogits.T @ hidden (rows without gradient zeroed, so a non-finite padding row cannot poison
    it) and the fp32 d bias [V] += column sums, the first group writing both (no zero fill).

    A group closes when the next chunk does not follow it, does not fit the store or needs another fp16 scale (the
    power of two that keeps fp16 dlogits above the subnormals, `_fp16_gradient_scale`, unscaled in the GEMMs' fp32
    alpha); without a separate store every chunk is its own group (its dlogits lie over its logits, which the next
    chunk's overwrite). hidden [N, D], weight [V, D]; needs: (d hidden, d weight, d bias). The gradients are
    allocated when made, the group's buffers in the workspace by `allocate_buffers`, which the first `add_chunk`
    needs (`loss_gradients` makes the groups before its host read and their buffers after the pre-pass, whose
    gathered rows the budget does not hold beside them)."""

    def __init__(self, workspace: Workspace, hidden, weight, needs: Tuple[bool, bool, bool]):
        needs_hidden, needs_weight, needs_bias = needs
        self.workspace, self.hidden, self.weight = workspace, hidden, weight
        self.grad_hidden = torch.empty_like(hidden, dtype=grad_hidden_dtype(hidden.dtype)) if needs_hidden else None
        self.grad_weight = (torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight
                            else None)
        self.grad_bias = (torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device) if needs_bias
                          else None)
        self.written = False  # d weight and d bias hold a group's sums (the first group writes them: no zero fill)
        self.store = self.gradient_rows = None  # `allocate_buffers`
        self.rows, self.scale, self.dlogits = None, 1.0, None  # the open group: its rows, fp16 scale, dlogits

    def allocate_buffers(self) -> None:
        """The workspace's group buffers: the dlogits store [group_rows, V] in hidden's dtype (with a separate store)
        and the open group's hidden rows [group_rows, D] with those receiving no gradient zeroed
        (`RowKernels.gradient_rows_into`; d weight's operand, when it is needed)."""
        workspace, hidden = self.workspace, self.hidden
        if workspace.separate_store:
            self.store = hidden.new_empty(workspace.group_rows, self.weight.shape[0])
        if self.grad_weight is not None:
            self.gradient_rows = hidden.new_empty(workspace.group_rows, hidden.shape[1])

    def add_chunk(self, rows: slice, hidden_rows, targets, logits, lse, entropy, grad_logp, grad_entropy,
                  kernels: RowKernels, transform: LogitTransform):
        """Write the dlogits of chunk `rows` (its hidden rows [n, D] and targets [n], as the caller sliced them for
        its logits GEMM and forward row kernel; its fp32 logits [n, V] in `logits`; lse, entropy, grad_logp,
        grad_entropy [n] fp32) of sum(grad_logp * logp + grad_entropy * entropy), times the fp16 scale, into its
        group, with the hidden rows d weight reads, running the GEMMs of the group it closes first (and, without a
        separate store, of its own after)."""
        scale = _fp16_gradient_scale(grad_logp, grad_entropy) if self.hidden.dtype == torch.float16 else 1.0
        separate_store = self.workspace.separate_store
        if self.rows is not None and (scale != self.scale or rows.start != self.rows.stop
                                      or rows.stop - self.rows.start > self.workspace.group_rows):
            self.close_group()
        if self.rows is None:
            self.rows, self.scale = slice(rows.start, rows.start), scale
        in_group = slice(rows.start - self.rows.start, rows.stop - self.rows.start)
        self.rows = slice(self.rows.start, rows.stop)
        self.dlogits = self.store[:in_group.stop] if separate_store else gradient_view(logits, self.hidden.dtype)
        if scale != 1.0:
            grad_logp, grad_entropy = grad_logp * scale, grad_entropy * scale
        kernels.backward_into(self.store[in_group] if separate_store else self.dlogits, logits, targets, lse, entropy,
                              grad_logp, grad_entropy, transform)
        if self.grad_weight is not None:
            kernels.gradient_rows_into(self.gradient_rows[in_group], hidden_rows, targets, grad_logp, grad_entropy)
        if not separate_store:  # the next chunk's logits overwrite these dlogits: a group a chunk
            self.close_group()

    def close_group(self) -> None:
        """The open group's GEMMs (one must be open): d hidden of its rows, d weight and d bias added (written by
        the first group), each product times 1 / its fp16 scale; the group then closed."""
        rows, dlogits, inverse = self.rows, self.dlogits, 1 / self.scale
        if self.grad_hidden is not None:
            write_grad_hidden(self.grad_hidden[rows], dlogits, self.weight, inverse)
        if self.grad_weight is not None:
            _accumulate_product(self.grad_weight, dlogits.t(), self.gradient_rows[:rows.stop - rows.start], inverse,
                                accumulate=self.written)
        if self.grad_bias is not None and self.written:
            self.grad_bias.add_(dlogits.sum(0, dtype=torch.float32), alpha=inverse)
        elif self.grad_bias is not None:  # 0 + inverse x sums, as the additions would make it
            torch.sum(dlogits, 0, dtype=torch.float32, out=self.grad_bias)
            if inverse != 1:
                self.grad_bias.mul_(inverse)
        self.written = True
        self.rows = self.dlogits = None

    def gradients(self):
        """(d hidden [N, D] in `grad_hidden_dtype`, d weight [V, D] fp32, d bias [V] fp32), None where not needed, after
        the last group's GEMMs: d weight and d bias are the fp32 accumulators, which whoever returns them rounds to
        the inputs' dtype once (`rounded`; the loss's backward, in its scale pass)."""
        if self.rows is not None:
            self.close_group()
        if not self.written:  # no row at all
            for gradient in (self.grad_weight, self.grad_bias):
                if gradient is not None:
                    gradient.zero_()
        return self.grad_hidden, self.grad_weight, self.grad_bias


def rounded(gradient: Optional[torch.Tensor], like: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """gradient (an fp32 accumulator or d hidden, or None) in like's dtype (no copy when it has it already)."""
    return None if gradient is None else gradient.to(like.dtype)


def token_forward(hidden, weight, bias, targets, transform: LogitTransform, kernels: RowKernels):
    """(logp, entropy, lse) [N] fp32 of the transformed logits hidden @ weight.T (+ bias), chunk by chunk
    (2 N D V FLOPs, the chunks of DEFAULT_WORKSPACE_BYTES): `fused_linear_token_logprobs`' forward, whose gradient is
    not known until its backward. Its logits come from the loss's GEMM (`epilogue_row_pass`: the epilogue's Triton
    GEMM and merge with EPILOGUE_ROW_PASS), so that the rows a trainer scores with it (old and reference log-probs,
    ell_theta0(q) at theta0) have the loss's own bits."""
    num_rows = hidden.shape[0]
    epilogue = epilogue_row_pass(kernels)
    max_rows = workspace_of(num_rows, hidden, weight, kernels, DEFAULT_WORKSPACE_BYTES, False, epilogue).chunk_rows
    logits_buffer = LogitsBuffer(max_rows, hidden, weight, bias, False, kernels, transform, epilogue)
    logp, entropy, lse = (torch.empty(num_rows, dtype=torch.float32, device=hidden.device) for _ in range(3))
    for rows in index_slices(num_rows, max_rows):
        logits_buffer.logits(hidden[rows])
        logits_buffer.row_values(rows.stop - rows.start, targets[rows], (logp[rows], entropy[rows], lse[rows]))
    return logp, entropy, lse


def token_backward(hidden, weight, bias, targets, transform: LogitTransform, lse, entropy, grad_logp, grad_entropy,
                   needs_hidden: bool, needs_weight: bool, needs_bias: bool, kernels: RowKernels):
    """(d hidden [N, D], d weight [V, D], d bias [V]) of sum(grad_logp * logp + grad_entropy * entropy), each None
    when not needed: the same chunks as `token_forward`, their logits formed again (2 N D V) and `GradientGroups`
    (4 N D V)."""
    num_rows = hidden.shape[0]
    epilogue = epilogue_row_pass(kernels)  # the forward's logits, formed again by its GEMM
    workspace = workspace_of(num_rows, hidden, weight, kernels, DEFAULT_WORKSPACE_BYTES, False, epilogue)
    logits_buffer = LogitsBuffer(workspace.chunk_rows, hidden, weight, bias, False, kernels, transform, epilogue)
    groups = GradientGroups(workspace, hidden, weight, (needs_hidden, needs_weight, needs_bias))
    groups.allocate_buffers()
    for rows in index_slices(num_rows, workspace.chunk_rows):
        hidden_rows = hidden[rows]
        groups.add_chunk(rows, hidden_rows, targets[rows], logits_buffer.logits(hidden_rows), lse[rows], entropy[rows],
                         grad_logp[rows], grad_entropy[rows], kernels, transform)
    grad_hidden, grad_weight, grad_bias = groups.gradients()
    return rounded(grad_hidden, hidden), rounded(grad_weight, weight), rounded(grad_bias, bias)


class RowChecksFailed(Exception):
    """The value checks' code that the op read with the layout (`fused_linear.DeferredCheckRead`) names a bad row:
    `code` [1 + K] int64, its host copy, from which the caller raises that row's own error."""

    def __init__(self, code: torch.Tensor):
        super().__init__("the value checks found a bad row (the loss raises its error)")
        self.code = code


def read_rows(token_kind, sample_index, check_code: Optional[torch.Tensor], host_layout: Optional[torch.Tensor]):
    """The call's one host read queued: a function returning (host code [K] int64 or None, host layout [2, N] int64)
    that waits only for this copy: the value checks' code when the op is to read it (`fused_linear.DeferredCheckRead`),
    and token_kind and sample_index unless the caller holds them (host_layout), concatenated into one copy."""
    parts = ([] if check_code is None else [check_code]) + (
        [token_kind.long(), sample_index.long()] if host_layout is None else [])
    if not parts:
        return lambda: (None, host_layout)
    read = read_later(parts[0] if len(parts) == 1 else torch.cat(parts))  # an O(N) vector
    checks = 0 if check_code is None else check_code.shape[0]

    def values():
        host = read().cpu()
        layout = host[checks:] if host_layout is None else host_layout  # [2 N] or [2, N]
        return (host[:checks] if checks else None), layout
    return values


def plannable_layout(host_layout: torch.Tensor, num_samples: int) -> bool:
    """Whether `plan_chunks` can run on host_layout [2, N] int64 (host memory): every token_kind in {0, 1, 2} and
    every sample_index of a scored row in [0, num_samples) (rows the value checks accept; elsewhere the plan could
    index past its arrays). A few passes over the host rows (the scored rows picked out only when some row's
    sample_index is out of range), no device work."""
    kind, sample = host_layout.numpy()
    if kind.size == 0:
        return True
    if kind.min() < 0 or kind.max() > 2:
        return False
    if sample.min() >= 0 and sample.max() < num_samples:
        return True
    scored = sample[kind != 0]  # rows of kind 0 may hold anything
    return scored.size == 0 or bool(scored.min() >= 0 and scored.max() < num_samples)


def loss_gradients(hidden, weight, bias, targets, token_kind, sample_index, inputs: LossInputs,
                   options: LossOptions, kernels: RowKernels, segment_sum, workspace_bytes: int,
                   needs: Tuple[bool, bool, bool], batch_invariant: bool = False,
                   entropy_pool: Optional[torch.Tensor] = None, host_layout: Optional[torch.Tensor] = None,
                   check_code: Optional[torch.Tensor] = None, spans: Optional[torch.Tensor] = None):
    """The 6NDV pass (module docstring) on validated inputs: hidden [N, D], weight [V, D], bias [V] or None,
    targets [N] int64 (-100 on rows of kind 0); entropy_pool [m] fp32: the entropy filter's pool when
    options.top_entropy_gather gathered one. Returns (logp [N] fp32, entropy [N] fp32, a 0-dim fp32 zero (the op's
    anchor), d hidden [N, D], d weight [V, D] fp32, d bias [V] fp32) of the loss, a gradient None where `needs`
    (hidden, weight, bias) is False; d weight and d bias are their fp32 accumulators (the op's backward rounds them
    once, scaled). host_layout [2, N] int64 in host memory: token_kind and sample_index as the caller read them
    (then no read of them here). check_code [1 + K] int64: the value checks' code, read here with the layout
    (`fused_linear.DeferredCheckRead`; the inputs are validated once it passes); RowChecksFailed when it names a bad
    row. spans [2, S] int64: each sample's span of scored rows as the value checks or the spans kernel found them
    (`ChunkObjectiveInputs`), or None.
    """
    num_rows, num_samples = hidden.shape[0], inputs.advantages.shape[0]
    transform = options.logit_transform
    epilogue = epilogue_row_pass(kernels)
    workspace = workspace_of(num_rows, hidden, weight, kernels, workspace_bytes, batch_invariant, epilogue)
    gather = options.top_entropy_gather is not None
    logits_buffer = LogitsBuffer(workspace.chunk_rows, hidden, weight, bias, batch_invariant, kernels, transform,
                                 epilogue)
    # The chunk plan needs the layout on the host: one read (a host-device sync on CUDA) of both tensors and of the
    # value checks' code, copied asynchronously so that a logits GEMM queued meanwhile runs while the host plans:
    # that of rows 0 to `early`, which the first chunk holds whatever the plan (at least half of min(chunk_rows, N)
    # rows), and which reads hidden and weight alone (safe on rows the checks may refuse). The read then waits for
    # the work queued before the call alone, and the host's work before it (the op's dispatch, this setup) runs
    # while that work does. (With the caller's host_layout and no code there is nothing to read; the first GEMM is
    # cut the same way all the same, so that the logits, and so the results, are those of a call without it.)
    early = _invariant_floor(min(workspace.chunk_rows, num_rows) // 2, batch_invariant)
    read = read_rows(token_kind, sample_index, check_code, host_layout)
    logits_buffer.logits(hidden[:early])
    # What does not depend on the layout is made before the read, so that the host's work between the read and the
    # first chunk's row kernel is the plan's and the objective's setup alone (the GPU runs dry there once the GEMMs
    # queued run out; before the read the host works while the GPU runs what was queued before the call, in a
    # training step the model): the rows' log-probs and entropies as the objective reads them (zeros, then the
    # pre-pass values and each chunk's own), each chunk's lse (read by its own backward), the op's anchor (zeroed
    # with the two in one launch), the objective's settings and outputs, and without the entropy filter its global
    # factors (two launches over every sample's span, on the zeroed vectors: counts alone), the gradients, the chunk
    # pass and the plan's settings. (The groups' buffers come after the pre-pass, whose gathered hidden rows the
    # workspace budget does not hold beside them.)
    logp_out, entropy_out, lse_out = (hidden.new_empty(num_rows, dtype=torch.float32) for _ in range(3))
    anchor = hidden.new_empty((), dtype=torch.float32)
    kernels.zero_fill(logp_out, entropy_out, anchor)
    objective = kernels.chunk_objective(ChunkObjectiveInputs(
        logp_out, entropy_out, token_kind, sample_index, spans, inputs, options, segment_sum, entropy_pool))
    groups = GradientGroups(workspace, hidden, weight, needs)
    # The first chunk's forward row kernel is queued before the objective's setup (`start`) unless that setup reads
    # the rows' values: with the entropy filter its threshold and kept-row count read the pre-passed response rows'
    # entropies, which the chunk's own values (formed by another GEMM shape, so not always the same bits) must not
    # replace first.
    chunk_pass = ChunkPass(logits_buffer, hidden, targets, transform, kernels, logp_out, entropy_out, lse_out,
                           objective, groups, first_forward_queued=options.top_entropy_quantile >= 1)
    coupling = dict(
        query_sums=(options.qkl_coef != 0 and options.qkl_estimator != "k3-token"
                    and inputs.ref_query_logp is not None),
        response_values=(options.ratio_level == "sequence" or options.pg_objective == "vespo"
                         or options.off_policy_mask_threshold is not None),
        all_response_entropies=options.top_entropy_quantile < 1 and (
            not gather or (options.entropy_coef != 0 and options.entropy_agg == "token-mean")))

    def plan_and_queue_first_chunk(host_kind, host_sample) -> ChunkPlan:
        """The chunk plan on the host layout, with the pre-pass and the first chunk's other rows' logits queued
        (its own GEMM, only earlier: the GPU runs them while the host sets the objective up), then the first
        chunk's forward row kernel when `chunk_pass.first_forward_queued` (its own too, only earlier: more work for
        the GPU while the host sets the objective up), the groups' buffers (host work: after the launches, which the
        GPU runs meanwhile) and the objective's setup on the layout (`start`)."""
        plan = plan_chunks(host_kind, host_sample, num_samples, workspace.chunk_rows, **coupling)
        first = early
        if plan.prepass_rows.size:  # it overwrites the buffer: the early rows' logits are formed again
            prepass = host_to_device(plan.prepass_rows, hidden.device)
            logp_out[prepass], entropy_out[prepass] = logp_entropy_of_rows(
                hidden, targets, prepass, workspace.chunk_rows, logits_buffer)
            first = 0
        logits_buffer.logits(hidden[first:plan.chunks[0][1] if plan.chunks else 0], first=first)
        if plan.chunks and chunk_pass.first_forward_queued:
            start, stop = plan.chunks[0]
            chunk_pass.forward(slice(start, stop), targets[start:stop])
        groups.allocate_buffers()
        if plan.chunks:
            objective.start(plan.chunks, host_kind, host_sample)
        return plan

    # With the caller's host_layout the plan needs nothing read: it is made, the pre-pass and the first chunk's
    # logits queued and the objective set up on the layout, before the wait for the value checks' code
    # (validate=True), which then waits for their copy alone while the GPU runs those GEMMs, and the chunk loop
    # follows the read at once. Only when the layout's own values can be planned on (`plannable_layout`: the
    # objective's layout then indexes within its arrays too); a row the checks refuse raises after the wait all the
    # same, what was queued having written the op's own buffers alone, by kernels safe on any row values (the forward
    # row kernels read a target outside [0, V) as column 0).
    planned_early = host_layout is not None and plannable_layout(host_layout, num_samples)
    if planned_early:
        host_kind, host_sample = host_layout.numpy()
        plan = plan_and_queue_first_chunk(host_kind, host_sample)
    code, layout = read()
    if code is not None and not rows_passed(code, num_rows):
        raise RowChecksFailed(code)
    if not planned_early:
        host_kind, host_sample = layout.numpy().reshape(2, num_rows)
        plan = plan_and_queue_first_chunk(host_kind, host_sample)
    for chunk, (start, stop) in enumerate(plan.chunks):
        chunk_pass.run(chunk, slice(start, stop))
    return (logp_out, entropy_out, anchor, *groups.gradients())


@dataclass(frozen=True)
class ChunkPass:
    """The work of one chunk in `loss_gradients`' loop (host work that the GPU waits for only when the host falls
    behind it: `python -m bench.host_cost --path fused` times it): the logits GEMM into `logits_buffer`, the forward
    row kernel into the rows of the call's [N] fp32 vectors logp, entropy and lse, the objective's gradient on
    the chunk's rows and its dlogits into `groups`. The first chunk's logits are formed with the plan
    (`loss_gradients`), and so is its forward row kernel when `first_forward_queued`."""

    logits_buffer: LogitsBuffer
    hidden: torch.Tensor
    targets: torch.Tensor
    transform: LogitTransform
    kernels: RowKernels
    logp: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    objective: object
    groups: GradientGroups
    first_forward_queued: bool

    def run(self, chunk: int, rows: slice) -> None:
        """Chunk number `chunk`, rows `rows`."""
        hidden_rows, targets = self.hidden[rows], self.targets[rows]  # sliced once: the GEMM, both row kernels
        buffer = self.logits_buffer
        logits = buffer.formed(rows.stop - rows.start) if chunk == 0 else buffer.logits(hidden_rows)
        if chunk == 0 and self.first_forward_queued:
            lse, entropy = self.lse[rows], self.entropy[rows]
        else:
            lse, entropy = self.forward(rows, targets)
        self.groups.add_chunk(rows, hidden_rows, targets, logits, lse, entropy, *self.objective.gradient(chunk, rows),
                              self.kernels, self.transform)

    def forward(self, rows: slice, targets):
        """The forward row pass (`LogitsBuffer.row_values`) of rows `rows` (targets [n]), whose logits the buffer's
        first n rows hold, into the call's vectors: (lse, entropy) [n] fp32, their rows."""
        _, entropy, lse = self.logits_buffer.row_values(rows.stop - rows.start, targets,
                                                        (self.logp[rows], self.entropy[rows], self.lse[rows]))
        return lse, entropy


# The torch.library op: what torch.compile sees (no graph break, no trace of the chunk loop). The options travel as
# one string (their numbers, strings, booleans and None), the tensor-valued num_items / num_seqs as tensors,
# and the entropy filter's gathered pool, when the caller gathers one, as a tensor.
_TENSOR_OPTIONS = ("num_items", "num_seqs", "top_entropy_gather")
OpOutputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def options_argument(options: LossOptions) -> str:
    """The op's `options` string, "name=repr;..." of every LossOptions field but the gather and num_items / num_seqs
    when tensors (an f-string of constants, which torch.compile folds; json.dumps it cannot trace)."""
    return ";".join(f"{name}={getattr(options, name)!r}" for name in OPTION_NAMES
                    if name not in _TENSOR_OPTIONS or (name != "top_entropy_gather"
                                                      and not isinstance(getattr(options, name), torch.Tensor)))


def options_from_argument(options: str, **tensor_options) -> LossOptions:
    """The LossOptions of an `options_argument` string, with the tensor-valued ones added."""
    return LossOptions(**dict(_option_values(options)), **tensor_options)


@functools.lru_cache(maxsize=64)
def _option_values(options: str) -> tuple:
    """((name, value), ...) of an `options_argument` string (numbers, strings, booleans, None: immutable), parsed
    once per distinct string: ast.literal_eval of its 31 options took 290 us a call on the CPU, host time after the
    validation's read that the GPU waits through."""
    return tuple((name, ast.literal_eval(value)) for name, value in (item.split("=", 1) for item in options.split(";")))


def loss_gradients_of_op_arguments(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                   targets: torch.Tensor, token_kind: torch.Tensor, sample_index: torch.Tensor,
                                   advantages: torch.Tensor, ref_query_logp: Optional[torch.Tensor],
                                   query_weight: Optional[torch.Tensor], old_logp: Optional[torch.Tensor],
                                   ref_logp: Optional[torch.Tensor], token_weight: Optional[torch.Tensor],
                                   rollout_logp: Optional[torch.Tensor], num_items: Optional[torch.Tensor],
                                   num_seqs: Optional[torch.Tensor], entropy_pool: Optional[torch.Tensor], options: str,
                                   kernels: str, workspace_bytes: int, batch_invariant: bool, needs_hidden: bool,
                                   needs_weight: bool, needs_bias: bool, host_layout: Optional[torch.Tensor],
                                   check_code: Optional[torch.Tensor], spans: Optional[torch.Tensor]) -> OpOutputs:
    """(logp [N], entropy [N] fp32, anchor 0-dim fp32 zero, d hidden [N, D] in `grad_hidden_dtype`, d weight [V, D]
    fp32, d bias [V] fp32) of the ERPO loss; a gradient not needed is an empty tensor. The anchor is the op's one
    differentiable output: its gradient scales the stored ones (loss = objective value + anchor), rounding d weight
    and d bias (and an fp32 d hidden) to the inputs' dtype once (kept in fp32 until then: no rounded copy in the
    forward). host_layout, check_code, spans: `loss_gradients`' (RowChecksFailed when the code names a bad row)."""
    extra = {name: value for name, value in (("num_items", num_items), ("num_seqs", num_seqs)) if value is not None}
    if entropy_pool is not None:
        extra["top_entropy_gather"] = lambda _entropies: entropy_pool
    opts = options_from_argument(options, **extra)
    inputs = LossInputs(advantages=advantages, ref_query_logp=ref_query_logp, query_weight=query_weight,
                        old_logp=old_logp, ref_logp=ref_logp, token_weight=token_weight, rollout_logp=rollout_logp)
    logp, entropy, anchor, *grads = loss_gradients(
        hidden.contiguous(), weight, bias, targets, token_kind, sample_index, inputs, opts, ROW_KERNELS[kernels],
        segment_sum_of(kernels == "triton"), workspace_bytes, (needs_hidden, needs_weight, needs_bias),
        batch_invariant, entropy_pool, host_layout, check_code, spans)
    return (logp, entropy, anchor, *(hidden.new_empty(0) if grad is None else grad for grad in grads))


loss_gradients_op = torch.library.custom_op("erpo::fused_linear_erpo_loss_gradients", loss_gradients_of_op_arguments,
                                            mutates_args=())
# The op's arguments by name, in its schema's order (inferred from the signature), the order in which autograd hands
# them to `_setup_context` and takes their gradients back from `_backward`
OP_ARGUMENTS = tuple(inspect.signature(loss_gradients_of_op_arguments).parameters)


@loss_gradients_op.register_fake
def _(hidden, weight, bias, targets, token_kind, sample_index, advantages, ref_query_logp, query_weight, old_logp,
      ref_logp, token_weight, rollout_logp, num_items, num_seqs, entropy_pool, options, kernels, workspace_bytes,
      batch_invariant, needs_hidden, needs_weight, needs_bias, host_layout, check_code, spans):
    logp = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    grads = [torch.empty_like(t, dtype=dtype) if needed else hidden.new_empty(0)
             for t, dtype, needed in ((hidden, grad_hidden_dtype(hidden.dtype), needs_hidden),
                                      (weight, torch.float32, needs_weight),
                                      (bias, torch.float32, needs_bias))]
    return (logp, torch.empty_like(logp), hidden.new_empty((), dtype=torch.float32), *grads)


def check_weight_unchanged(weight, forward_shape) -> None:
    """Raise when the weight's shape changed since the forward: DeepSpeed ZeRO-3 re-partitioned it (a backward
    after the `whole_lm_head` block)."""
    if weight.shape != forward_shape:
        raise RuntimeError(f"the weight changed shape between forward {tuple(forward_shape)} and backward "
                           f"{tuple(weight.shape)}: under DeepSpeed ZeRO-3 run the backward inside "
                           f"erpo_kernels.zero3.gathered_lm_head(...) so the lm_head stays gathered")


def _setup_context(ctx, inputs, output):
    arguments = dict(zip(OP_ARGUMENTS, inputs))
    logp, entropy, _anchor, *grads = output
    ctx.save_for_backward(arguments["weight"], *grads)  # the weight only to see whether ZeRO-3 re-partitioned it
    ctx.weight_shape = arguments["weight"].shape
    ctx.dtypes = [None if arguments[name] is None else arguments[name].dtype for name in ("hidden", "weight", "bias")]
    # the other outputs take no gradient: autograd would fill zeros of their shapes for `_backward` to ignore
    # (logp and entropy [N], d hidden [N, D], d weight [V, D] and d bias [V]: memory-bound fills of the gradients' size)
    ctx.set_materialize_grads(False)
    ctx.triton = arguments["kernels"] == "triton"
    ctx.mark_non_differentiable(logp, entropy, *grads)


def _backward(ctx, _grad_logp, _grad_entropy, grad_anchor, *_grad_grads):
    """d hidden, d weight, d bias: the stored gradients (d weight and d bias the fp32 accumulators, d hidden in
    `grad_hidden_dtype`) times d loss / d anchor (1 for loss.backward()), each product formed in fp32 and rounded
    once to its input's dtype: one vectorized pass each on the Triton backend (`triton_scale`), torch ops on the
    torch one."""
    weight, *stored = ctx.saved_tensors
    check_weight_unchanged(weight, ctx.weight_shape)
    if grad_anchor is None:  # not materialized: no gradient reached the anchor
        return (None,) * len(OP_ARGUMENTS)
    if ctx.triton:
        from .triton_scale import scaled_op  # Triton is imported only when its kernels run
        scale = scaled_op
    else:
        def scale(grad, factor, dtype):
            return (grad.float() * factor).to(dtype)
    grads = [scale(grad, grad_anchor, dtype) if needed and grad.numel() else None
             for grad, dtype, needed in zip(stored, ctx.dtypes, ctx.needs_input_grad[:3])]  # hidden, weight, bias
    return (*grads, *([None] * (len(OP_ARGUMENTS) - len(grads))))


loss_gradients_op.register_autograd(_backward, setup_context=_setup_context)
