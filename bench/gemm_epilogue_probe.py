"""Can the fused path's forward row pass move into its logits GEMM's epilogue, in one short GPU run: a Triton GEMM
at the chunks' shape beside cuBLAS, with and without the row statistics in its epilogue (issue 32).

    python -m bench.gemm_epilogue_probe --shapes qwen2.5-7b,qwen2.5-32b --rows 512,2048 --out DIR
    TRITON_INTERPRET=1 python -m bench.gemm_epilogue_probe --smoke --out DIR     # CPU, tiny: the dry run

Per shape (D, V) and chunk rows n, one chunk's [n, D] x [D, V] product with fp32 output, bf16 operands:

  (a) cuBLAS: `fused_linear_loss._write_logits`, the fused path's own call (`torch.mm(h, W.t(),
      out_dtype=torch.float32, out=buffer)` on CUDA);
  (b) (a), then the library's forward row kernel on the buffer (`fused_linear_loss.ROW_KERNELS["triton"].forward`):
      what the fused path does per chunk, (logp, entropy, lse) of every row;
  (c) this module's Triton GEMM writing the fp32 logits, per config of CONFIGS (BLOCK_M x BLOCK_N x BLOCK_K, warps,
      stages), in four launches (`launches`): grouped (one program per output tile, GROUP_M row tiles side by side,
      the Triton matmul tutorial's swizzle, so that a wave's programs share their operands in L2) and persistent (one
      program per SM, each walking the tiles in that grouped order), each with its operands loaded through pointers
      (cp.async, compiled) and through TMA tensor descriptors (Hopper's copy engine);
  (d) the same GEMM with the row statistics in its epilogue, then `_combine_kernel`: per (row, vocabulary tile) the
      tile's max m, s = sum exp(z - m) and u = sum exp(z - m) (z - m) (`triton_common.online_softmax_step`, the
      forward row kernels' own step: u is shifted by m, no cancellation in the entropy) into a [n, tiles, 3] fp32
      side buffer, the fp32 logits still written (the backward row pass reads them); the combine merges a row's tiles
      into (logp, entropy, lse) as the forward row kernel defines them (its docstring has the merge), the target's
      logit read from the buffer. The identity transform only: temperature 1, no logit scale, no soft-cap.

Before it is timed, each variant is checked on the device against (a) (logits) and (b) (logp, entropy, lse): its
largest absolute errors are in the report, and a variant beyond LOGITS_TOLERANCE or STATS_TOLERANCE is marked
failing and never named the best (its time is still shown). Times: bench/timing.py's `time_callable` (CUDA events,
2 warm-up calls, the median of `--repeats`); TFLOP/s is 2 n D V over the time. The answer per (shape, rows): the best
passing (d) against (b), per chunk and, as arithmetic on this run's medians (not a measurement), over N = 16384
rows in chunks of n (ceil(N / n) times the chunk's time).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from erpo_kernels.common import LSE_FLOOR
from erpo_kernels.triton_common import clamp, online_softmax_finish, online_softmax_start, online_softmax_step
from erpo_kernels.validation import IGNORE_INDEX, LogitTransform

from .provenance import header_lines, provenance, write_report
from .timing import time_callable

# Triton reads TRITON_INTERPRET when a kernel is defined (below): the interpreter's tl.dot on bf16 tiles returns
# garbage (Triton 3.6), so there the tiles go to fp32 first; compiled, they stay bf16 (Hopper's bf16 MMA)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GROUP_M = 8                 # row tiles side by side in the grouped order (the matmul tutorial's choice)
LOGITS_TOLERANCE = 1e-4     # largest |logit - cuBLAS's| over (1 + largest |logit|): both sum exact bf16 products in
#                             fp32, in different orders (about 1e-6 expected at D = 3584 with the probe's data)
STATS_TOLERANCE = 1e-4      # nats, largest |lse|, |entropy|, |logp| error against (b)'s (about 1e-6 expected): a
#                             column counted twice or lost moves lse by exp(z_j - lse), about 1 / V = 7e-6 at
#                             V = 152064, below this; the interpreter's tests (small V) catch those
PROBE_N = 16384             # the rows the answer's arithmetic scales a chunk's time to (the fused targets' N)


class GemmConfig(NamedTuple):
    """One launch configuration of the Triton GEMM: its output tile, its K step, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


# Hopper-sized tiles: operand stages of (BLOCK_M + BLOCK_N) BLOCK_K bf16 each, 144 KiB for three 128x256x64 ones,
# within an H100's 227 KiB of shared memory per block
CONFIGS = (GemmConfig(128, 256, 64, 8, 3), GemmConfig(128, 128, 64, 4, 4), GemmConfig(256, 128, 64, 8, 3))


class Launch(NamedTuple):
    """How the Triton GEMM runs: `programs` persistent programs walking the tiles (None: one program per tile), both
    in the grouped order; its operands loaded through pointers or, with `tma`, Hopper's TMA (tensor descriptors)."""

    programs: int | None = None
    tma: bool = False

    def __str__(self) -> str:
        return ("grouped" if self.programs is None else f"persistent ({self.programs})") + (", TMA" if self.tma else "")


def launches(programs: int) -> tuple:
    """The launches each config is timed in: grouped and persistent on `programs` programs, pointers then TMA."""
    return tuple(Launch(persistent, tma) for tma in (False, True) for persistent in (None, programs))


# the dry run: D = 40 and V = 200 are multiples of no block (the K step's mask, the ragged vocabulary tile), 24 rows
# of neither block's rows; the persistent launches on 3 programs, so that each walks several tiles
SMOKE = {"shape": "40x200", "rows": "24", "configs": (GemmConfig(16, 32, 16, 4, 1), GemmConfig(32, 64, 16, 4, 2)),
         "repeats": 1, "programs": 3}


@triton.jit
def _grouped_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, vocabulary tile) of output tile number `tile` in the grouped order: GROUP_M row tiles (fewer in
    the last group) take the vocabulary tiles in turn, so that consecutive tiles share a column of W's tiles and
    a group's rows of hidden (the Triton matmul tutorial's swizzle)."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    within = tile % per_group
    return first_m + within % group_rows, within // group_rows


@triton.jit
def _dot_step(a, b, acc, DOT_IN_FP32: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] @ b [BLOCK_N, BLOCK_K].T in fp32; the tiles go to fp32 first under the interpreter
    (INTERPRETED)."""
    if DOT_IN_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _tile_product(hidden, weight, first_row, first_column, rows, vocab, DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32 tile of hidden [rows, DIM] @ weight [vocab, DIM].T from row first_row and column
    first_column. With TMA, hidden and weight are tensor descriptors of [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K]
    boxes, which Hopper's TMA unit copies into shared memory, zeros past every edge; else pointers, and rows and
    columns past the edge read row 0 / column 0 instead (the loads stay unmasked and vectorized, the matmul
    tutorial's way). Values past the edge are never stored or counted. DIM is a constexpr so that the K loop is a
    `for` over a compile-time range: software-pipelined compiled (num_stages), and no run-time bound for the
    interpreter's `range` (erpo_kernels/triton_common.py, "Loop bounds")."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        for k in range(0, DIM, BLOCK_K):
            acc = _dot_step(hidden.load([first_row, k]), weight.load([first_column, k]), acc, DOT_IN_FP32)
    else:
        offs_m = first_row + tl.arange(0, BLOCK_M)
        offs_n = first_column + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        hidden_tile = hidden + tl.where(offs_m < rows, offs_m, 0).to(tl.int64)[:, None] * DIM + offs_k[None, :]
        weight_tile = weight + tl.where(offs_n < vocab, offs_n, 0).to(tl.int64)[:, None] * DIM + offs_k[None, :]
        for k in range(0, DIM, BLOCK_K):
            if DIM % BLOCK_K == 0:
                a = tl.load(hidden_tile)
                b = tl.load(weight_tile)
            else:  # the last K step reads zeros past DIM
                a = tl.load(hidden_tile, mask=offs_k[None, :] < DIM - k, other=0.0)
                b = tl.load(weight_tile, mask=offs_k[None, :] < DIM - k, other=0.0)
            acc = _dot_step(a, b, acc, DOT_IN_FP32)
            hidden_tile += BLOCK_K
            weight_tile += BLOCK_K
    return acc


@triton.jit
def _logits_gemm_kernel(hidden, weight, logits_ptr, stats_ptr, rows, vocab, logits_stride, num_programs,
                        DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, ROW_STATS: tl.constexpr, TMA: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                        _LSE_FLOOR: tl.constexpr = LSE_FLOOR):
    """logits [rows, vocab] fp32 (row stride logits_stride) := hidden [rows, DIM] @ weight [vocab, DIM].T, bf16 (or
    fp16 / fp32) operands summed in fp32; hidden and weight pointers, or with TMA tensor descriptors
    (`_tile_product`). Program p computes tiles p, p + num_programs, ... in the grouped order: one
    tile each when the grid is the tile count, a persistent walk when it is the SM count. With ROW_STATS, each tile's
    (m, s, u) per row (module docstring) go to stats [rows, tiles_n, 3] fp32. LSE_FLOOR is a parameter with a plain
    number as its default, as in the library's kernels (a global would be checked on every launch)."""
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(vocab, BLOCK_N)
    tile = tl.program_id(0)
    while tile < tiles_m * tiles_n:  # a run-time bound: `while`, not `range` (_tile_product's docstring)
        tile_m, tile_n = _grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_product(hidden, weight, tile_m * BLOCK_M, tile_n * BLOCK_N, rows, vocab, DIM, BLOCK_M, BLOCK_N,
                            BLOCK_K, TMA, DOT_IN_FP32)
        row_inside = offs_m < rows
        column_inside = offs_n < vocab
        tl.store(logits_ptr + offs_m.to(tl.int64)[:, None] * logits_stride + offs_n[None, :], acc,
                 mask=row_inside[:, None] & column_inside[None, :])
        if ROW_STATS:
            # the forward row kernels' own step from its start: the tile's max (never below LSE_FLOOR), s and u;
            # columns past the vocabulary are -inf, which adds nothing to s or u
            start_max, start_sum, start_shifted = online_softmax_start(BLOCK_M, _LSE_FLOOR)
            tile_max, sum_exp, sum_exp_shifted = online_softmax_step(
                start_max, start_sum, start_shifted, tl.where(column_inside[None, :], acc, float("-inf")))
            stats = stats_ptr + (offs_m.to(tl.int64) * tiles_n + tile_n) * 3
            tl.store(stats, tile_max, mask=row_inside)
            tl.store(stats + 1, sum_exp, mask=row_inside)
            tl.store(stats + 2, sum_exp_shifted, mask=row_inside)
        tile += num_programs


@triton.jit
def _combine_kernel(stats_ptr, logits_ptr, logits_stride, targets_ptr, logp_ptr, entropy_ptr, lse_ptr, tiles,
                    TILES_BLOCK: tl.constexpr, _LSE_FLOOR: tl.constexpr = LSE_FLOOR,
                    _IGNORE_INDEX: tl.constexpr = IGNORE_INDEX):
    """Row r's (logp, entropy, lse) from its tiles' (m_i, s_i, u_i) in stats [rows, tiles, 3] (one program a row).

    The merge (the online softmax's, over all tiles at once): with M = max_i m_i and c_i = exp(m_i - M),
        s_i = sum_{j in i} exp(z_j - m_i)  =>  S = sum_j exp(z_j - M) = sum_i c_i s_i,
        u_i = sum_{j in i} exp(z_j - m_i)(z_j - m_i), and z_j - M = (z_j - m_i) + (m_i - M), so
        U = sum_j exp(z_j - M)(z_j - M) = sum_i c_i (u_i + (m_i - M) s_i);
    then lse = M + log S and H = -sum_j p_j log p_j = log S - U / S (`online_softmax_finish`), as the forward row
    kernel's running values give them. logp = z_t - lse, clamped to <= 0 (z_t is one of lse's terms), 0 for a
    target of -100; z_t read from the fp32 logits [rows, V] (row stride logits_stride). Padding tiles (past `tiles`)
    enter as m = LSE_FLOOR, s = u = 0: c_i (u_i + (m_i - M) s_i) = 0, finite."""
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, TILES_BLOCK)
    inside = index < tiles
    stats = stats_ptr + (row * tiles + index) * 3
    tile_max = tl.load(stats, mask=inside, other=_LSE_FLOOR)
    sum_exp = tl.load(stats + 1, mask=inside, other=0.0)
    sum_exp_shifted = tl.load(stats + 2, mask=inside, other=0.0)
    row_max = tl.max(tile_max, axis=0)
    offset = tile_max - row_max
    scale = tl.exp(offset)
    total = tl.sum(scale * sum_exp, axis=0)
    total_shifted = tl.sum(scale * (sum_exp_shifted + offset * sum_exp), axis=0)
    log_total, entropy = online_softmax_finish(total, total_shifted)
    lse = row_max + log_total
    target = tl.load(targets_ptr + row)
    scored = target != _IGNORE_INDEX
    target_logit = tl.load(logits_ptr + row * logits_stride + tl.where(scored, target, 0))
    tl.store(logp_ptr + row, tl.where(scored, clamp(target_logit - lse, None, 0.0), 0.0))
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_ptr + row, lse)


def _check_operands(hidden: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [n, D] and weight [V, D] must share D; got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype or not (hidden.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"hidden and weight must be contiguous and of one dtype; got {hidden.dtype} and "
                         f"{weight.dtype} (contiguous: {hidden.is_contiguous()}, {weight.is_contiguous()})")
    if logits.dtype != torch.float32 or logits.shape != (hidden.shape[0], weight.shape[0]) or logits.stride(1) != 1:
        raise ValueError(f"logits must be fp32 [{hidden.shape[0]}, {weight.shape[0]}] with contiguous rows; got "
                         f"{logits.dtype} {tuple(logits.shape)}, strides {logits.stride()}")


def tile_count(vocab: int, config: GemmConfig) -> int:
    """Vocabulary tiles of a row under `config`: the side buffer's middle dimension."""
    return triton.cdiv(vocab, config.block_n)


def logits_gemm(hidden, weight, logits, config: GemmConfig, launch: Launch = Launch(), stats=None) -> None:
    """logits [n, V] fp32 := hidden [n, D] @ weight [V, D].T (bf16, fp16 or fp32 operands, summed in fp32), and with
    `stats` ([n, tile_count(V, config), 3] fp32) each (row, vocabulary tile)'s (m, s, u), launched as `launch` says
    (its programs, its loads)."""
    _check_operands(hidden, weight, logits)
    dim = hidden.shape[1]
    if launch.tma and dim * hidden.element_size() % 16:
        raise ValueError(f"TMA loads need rows of a multiple of 16 bytes; hidden's are {hidden.shape[1]} x "
                         f"{hidden.element_size()} bytes: use a pointer launch (Launch(tma=False))")
    rows, vocab = logits.shape
    tiles = triton.cdiv(rows, config.block_m) * tile_count(vocab, config)
    if stats is not None and (stats.dtype != torch.float32 or stats.shape != (rows, tile_count(vocab, config), 3)
                              or not stats.is_contiguous()):
        raise ValueError(f"stats must be a contiguous fp32 [{rows}, {tile_count(vocab, config)}, 3] tensor for "
                         f"{config}; got {stats.dtype} {tuple(stats.shape)}")
    grid = min(launch.programs, tiles) if launch.programs else tiles
    if launch.tma:
        hidden = TensorDescriptor.from_tensor(hidden, [config.block_m, config.block_k])
        weight = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    _logits_gemm_kernel[(grid,)](hidden, weight, logits, logits if stats is None else stats, rows, vocab,
                                 logits.stride(0), grid, DIM=dim, BLOCK_M=config.block_m,
                                 BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=GROUP_M,
                                 ROW_STATS=stats is not None, TMA=launch.tma, DOT_IN_FP32=INTERPRETED,
                                 num_warps=config.num_warps, num_stages=config.num_stages)


def combine_stats(stats, logits, targets, out) -> None:
    """out = (logp, entropy, lse), three [n] fp32 tensors, from stats [n, tiles, 3] fp32 (`logits_gemm`'s), the
    logits [n, V] fp32 it wrote and targets [n] int64 (-100: ignored); `_combine_kernel` has the merge."""
    rows, tiles, _ = stats.shape
    _combine_kernel[(rows,)](stats, logits, logits.stride(0), targets, *out, tiles,
                             TILES_BLOCK=triton.next_power_of_2(tiles))


class Variant(NamedTuple):
    """One timed row: its part ("a" to "d"), its config and launch (None for cuBLAS's parts) and its call."""

    part: str
    config: GemmConfig | None
    launch: Launch | None
    call: object


class Chunk:
    """One chunk's inputs and outputs at (rows, D, V): bf16 hidden [rows, D] and weight [V, D] (scaled as the bench's
    lm_head, 0.02), targets [rows] with every fourth -100 (the query rows' share), the fp32 logits buffer and the
    three [rows] fp32 vectors, one set shared by every variant; (a)'s logits and (b)'s vectors kept as the reference."""

    def __init__(self, rows: int, dim: int, vocab: int, device: torch.device, seed: int = 0):
        generator = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: W is 1.6 GB at 32b
        self.hidden = torch.randn(rows, dim, generator=generator, device=device).to(torch.bfloat16)
        self.weight = (torch.randn(vocab, dim, generator=generator, device=device) * 0.02).to(torch.bfloat16)
        self.targets = torch.randint(0, vocab, (rows,), generator=generator, device=device)
        self.targets[::4] = IGNORE_INDEX
        self.transform = LogitTransform()  # the identity: temperature 1, no scale, no soft-cap
        self.logits = torch.empty(rows, vocab, device=device, dtype=torch.float32)
        self.vectors = tuple(torch.empty(rows, device=device, dtype=torch.float32) for _ in range(3))
        self.side_buffers = []  # (d)'s [rows, tiles, 3] statistics, one per config (`variants`)
        self.cublas()
        self.row_pass()
        self.reference_logits = self.logits.clone()
        self.reference_vectors = tuple(vector.clone() for vector in self.vectors)

    def cublas(self) -> None:
        """(a): the fused path's logits GEMM into the buffer."""
        from erpo_kernels.fused_linear_loss import _write_logits
        _write_logits(self.logits, self.hidden, self.weight, None)

    def row_pass(self) -> None:
        """The library's forward row kernel on the buffer, into the vectors (logp, entropy, lse)."""
        from erpo_kernels.fused_linear_loss import ROW_KERNELS
        ROW_KERNELS["triton"].forward(self.logits, self.targets, self.transform, self.vectors)

    def variants(self, configs, programs: int) -> list:
        """[Variant] of parts (a) to (d): (c) and (d) once per config and launch (`launches(programs)`)."""
        out = [Variant("a", None, None, self.cublas),
               Variant("b", None, None, lambda: (self.cublas(), self.row_pass()))]
        for part in ("c", "d"):
            for config in configs:
                stats = None
                if part == "d":
                    stats = torch.empty(self.logits.shape[0], tile_count(self.logits.shape[1], config), 3,
                                        device=self.logits.device)
                    self.side_buffers.append(stats)
                for launch in launches(programs):
                    out.append(Variant(part, config, launch, self._triton_call(config, launch, stats)))
        return out

    def _triton_call(self, config, launch: Launch, stats):
        def call():
            logits_gemm(self.hidden, self.weight, self.logits, config, launch, stats)
            if stats is not None:
                combine_stats(stats, self.logits, self.targets, self.vectors)
        return call

    def reset(self) -> None:
        """NaN into every output buffer: what a variant leaves unwritten (a tile skipped, a statistic not stored) then
        fails its check instead of passing on an earlier variant's values."""
        for buffer in (self.logits, *self.vectors, *self.side_buffers):
            buffer.fill_(math.nan)

    def errors(self, part: str) -> dict:
        """The largest absolute errors of what `part`'s call just wrote: logits against (a)'s and, for (b) and (d),
        logp, entropy and lse against (b)'s (NaN where any value is not finite)."""
        def largest(value, reference):
            return float((value - reference).abs().max()) if bool(value.isfinite().all()) else math.nan

        out = {"logits": largest(self.logits, self.reference_logits)}
        if part in ("b", "d"):
            out.update(zip(("logp", "entropy", "lse"), map(largest, self.vectors, self.reference_vectors)))
        return out

    def passes(self, errors: dict) -> bool:
        """Whether `errors` are within LOGITS_TOLERANCE (relative to the largest logit) and STATS_TOLERANCE."""
        logit_bound = LOGITS_TOLERANCE * (1.0 + float(self.reference_logits.abs().max()))
        return all(error <= (logit_bound if name == "logits" else STATS_TOLERANCE) for name, error in errors.items())


def probe_chunk(rows: int, dim: int, vocab: int, device: torch.device, configs, programs: int, repeats: int,
                warmup: int) -> list:
    """[row dict] of every variant at one chunk: part, config, launch, errors, passed, median / p20 / p80 ms and
    TFLOP/s (2 rows D V over the median), or the error a variant raised (then not timed)."""
    chunk = Chunk(rows, dim, vocab, device)
    flops = 2 * rows * dim * vocab
    out = []
    for variant in chunk.variants(configs, programs):
        row = {"part": variant.part, "config": None if variant.config is None else str(variant.config),
               "launch": None if variant.launch is None else str(variant.launch)}
        try:
            chunk.reset()
            variant.call()
            row["errors"] = chunk.errors(variant.part)
            row["passed"] = chunk.passes(row["errors"])
            timing = time_callable(variant.call, device=device, warmup=warmup, reps=repeats)
        except Exception as error:  # a config this device refuses (shared memory, registers): say so, go on
            row.update(passed=False, error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
        else:
            row.update(median_ms=timing.median_ms, p20_ms=timing.p20_ms, p80_ms=timing.p80_ms,
                       tflops=flops / timing.median_ms / 1e9)
        out.append(row)
    return out


def best(rows: list, part: str):
    """The fastest timed row of `part` that passed its check, or None."""
    passing = [row for row in rows if row["part"] == part and row["passed"] and "median_ms" in row]
    return min(passing, key=lambda row: row["median_ms"], default=None)


def answer(rows: list, chunk_rows: int, total_rows: int = PROBE_N) -> dict:
    """Does (d) beat (b) at this chunk: the best passing (d)'s and (b)'s medians, their difference per chunk (ms,
    positive: (d) faster) and ratio, and both over total_rows rows in chunks of chunk_rows (arithmetic on these
    medians, not a measurement); the best (c) against (a) beside it. None where a part has no passing row."""
    chunks = math.ceil(total_rows / chunk_rows)
    pairs = {}
    for ours, theirs in (("d", "b"), ("c", "a")):
        mine, base = best(rows, ours), best(rows, theirs)
        pairs[ours] = None if mine is None or base is None else {
            "config": mine["config"], "launch": mine["launch"], "ms": mine["median_ms"], "base_ms": base["median_ms"],
            "saved_ms": base["median_ms"] - mine["median_ms"], "ratio": mine["median_ms"] / base["median_ms"],
            "chunks": chunks, "total_ms": chunks * mine["median_ms"], "base_total_ms": chunks * base["median_ms"]}
    return pairs


PART_NAMES = {"a": "(a) cuBLAS logits", "b": "(b) cuBLAS + forward row kernel", "c": "(c) Triton GEMM",
              "d": "(d) Triton GEMM + row stats + combine"}


def table_lines(rows: list) -> list:
    """One chunk's rows as a markdown table."""
    lines = ["| part | config | launch | ms (median) | p20 | p80 | TFLOP/s | max error: logits | lse | entropy | "
             "logp | check |", "|---" * 12 + "|"]
    for row in rows:
        errors = row.get("errors", {})
        cells = [f"{errors[name]:.2e}" if name in errors else "-" for name in ("logits", "lse", "entropy", "logp")]
        times = ([f"{row[key]:.3f}" for key in ("median_ms", "p20_ms", "p80_ms")] + [f"{row['tflops']:.3g}"]
                 if "median_ms" in row else ["-"] * 4)
        check = "passed" if row["passed"] else ("error: " + row["error"] if "error" in row else "FAILED")
        lines.append(f"| {PART_NAMES[row['part']]} | {row['config'] or '-'} | {row['launch'] or '-'} | "
                     + " | ".join(times + cells) + f" | {check} |")
    return lines


def answer_lines(pairs: dict, chunk_rows: int) -> list:
    """The answer's sentences for one chunk (`answer`'s)."""
    lines = []
    for ours, theirs, what in (("d", "b", "the forward row pass in the GEMM's epilogue"),
                               ("c", "a", "the Triton GEMM alone against cuBLAS")):
        pair = pairs[ours]
        if pair is None:
            lines.append(f"- {what}: no answer, ({ours}) or ({theirs}) has no passing timed row")
            continue
        verdict = "beats" if pair["saved_ms"] > 0 else "does not beat"
        lines.append(f"- {what}: ({ours}) {pair['config']} {pair['launch']} {verdict} ({theirs}): {pair['ms']:.3f} "
                     f"against {pair['base_ms']:.3f} ms per chunk of {chunk_rows} rows ({pair['saved_ms']:+.3f} ms "
                     f"saved, {pair['ratio']:.3f}x); over N={PROBE_N} in {pair['chunks']} chunks, "
                     f"{pair['total_ms']:.1f} against {pair['base_total_ms']:.1f} ms (arithmetic from this run's "
                     "medians, not a measurement)")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.gemm_epilogue_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-32b")
    parser.add_argument("--rows", default="512,2048", help="chunk rows n, a comma list")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, Triton interpreter: a dry run")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD, if any)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from .problem import parse_shape
    if args.smoke and not INTERPRETED:
        raise SystemExit("bench.gemm_epilogue_probe: --smoke runs the kernels in Triton's interpreter; set "
                         "TRITON_INTERPRET=1 (TRITON_INTERPRET=1 python -m bench.gemm_epilogue_probe --smoke ...)")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench.gemm_epilogue_probe: needs a CUDA device (or --smoke for the CPU dry run)")
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = [parse_shape(spec) for spec in (SMOKE["shape"] if args.smoke else args.shapes).split(",")]
    chunk_rows = [int(rows) for rows in (SMOKE["rows"] if args.smoke else args.rows).split(",")]
    configs = SMOKE["configs"] if args.smoke else CONFIGS
    repeats, warmup = (SMOKE["repeats"], 0) if args.smoke else (args.repeats, 2)
    programs = (SMOKE["programs"] if args.smoke
                else torch.cuda.get_device_properties(device).multi_processor_count)
    name = "CPU dry run" if args.smoke else torch.cuda.get_device_name()
    record = provenance("bench.gemm_epilogue_probe", sys.argv[1:] if argv is None else argv, args.commit)
    lines = [f"# The logits GEMM with the row statistics in its epilogue ({name}, bf16 operands, fp32 logits)", "",
             *header_lines(record),
             f"- (c), (d): Triton GEMM configs {', '.join(map(str, configs))}; launches "
             f"{'; '.join(map(str, launches(programs)))} (persistent (P): P programs, the SM count; 3 in the dry run); "
             "(d)'s row statistics for the identity transform (temperature 1, no scale or soft-cap)",
             f"- checks: logits within {LOGITS_TOLERANCE:g} x (1 + largest |logit|) of (a)'s, lse / entropy / logp "
             f"within {STATS_TOLERANCE:g} nats of (b)'s; a FAILED row is timed but never the best", ""]
    measured = {"meta": {**record, "device": name, "repeats": repeats, "warmup": warmup, "programs": programs,
                         "configs": [str(config) for config in configs], "group_m": GROUP_M,
                         "logits_tolerance": LOGITS_TOLERANCE, "stats_tolerance": STATS_TOLERANCE},
                "chunks": []}
    for shape in shapes:
        for rows in chunk_rows:
            results = probe_chunk(rows, shape.hidden, shape.vocab, device, configs, programs, repeats, warmup)
            pairs = answer(results, rows)
            block = [f"## {shape.name}: D={shape.hidden}, V={shape.vocab}, {rows} rows", "", *table_lines(results),
                     "", *answer_lines(pairs, rows), ""]
            lines += block
            print("\n".join(block), flush=True)
            measured["chunks"].append({"shape": shape.name, "hidden": shape.hidden, "vocab": shape.vocab,
                                       "rows": rows, "results": results, "answer": pairs})
            # written after every chunk: a run stopped at its time limit (bench/gpu_check.py) leaves the chunks done
            report = write_report(args.out, "gemm_epilogue_probe.md", lines)
            report.with_name("gemm_epilogue_probe.json").write_text(json.dumps(measured, indent=1) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()  # this chunk's buffers, freed with it


if __name__ == "__main__":
    main()
