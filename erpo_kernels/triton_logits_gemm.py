"""The fused path's logits GEMM in Triton with the forward row pass in its epilogue (issue 32).

One chunk's fp32 logits [n, V] = hidden [n, D] @ W.T (+ bias), and, in the same kernel, per (row, vocabulary tile)
of the transformed logits z (`validation.LogitTransform`, as the forward row kernels apply it) the tile's online
softmax statistics: its max m, s = sum exp(z - m) and u = sum exp(z - m) (z - m) (`triton_common`'s step, the forward
row kernels' own: u shifted by m, no cancellation in the entropy), into a [n, tiles, 3] fp32 side buffer. A second
kernel merges a row's tiles into its (logp, entropy, lse) as the forward row kernel defines them
(`_combine_kernel`'s docstring has the derivation). The fp32 logits (raw, before the transform, the bias added) are
still written: the backward row kernel reads them. Against cuBLAS + the forward row kernel, that saves the row
pass's read of the logits (10 GB per 16384 rows at Qwen2.5-7B's V = 152064); bench/gemm_epilogue_probe.py measures
both, and `fused_linear_loss.EPILOGUE_ROW_PASS` puts this in the fused loss's chunk loop (and in
`fused_linear_token_logprobs`' chunks, which score rows as the loss does).

Raw kernels first (`_grouped_tile`, `_dot_step`, `_tile_product`, `_logits_gemm_kernel`, `_combine_kernel`), then
the launchers (`logits_gemm`, `combine_stats`) and the fused loss's use of them (`EpilogueRowPass`).

A launch (`Launch`) runs one program per output tile or a persistent grid whose programs walk the tiles: a count
given, or DEVICE_SMS, one program per SM of the operands' device, read once per device at the call (`sm_count`:
114 on an H100 PCIe, 132 on an H100 SXM or an H200; INTERPRETER_SMS on the CPU). Which program takes a tile changes
nothing in it: every launch writes the same bits (tests/kernels/test_epilogue_row_pass.py).

A row's values do not depend on the rows beside it: each output element is one K loop in a fixed order over its own
row of hidden and column of W (BLOCK_K steps; no split-K, no choice of kernel by the row count), and its tile's
statistics are per row. So a row's logits, logp, entropy and lse are the same whatever chunk it lands in, and at
whatever place in its row tile (tests/kernels/test_epilogue_row_pass.py checks it, in the interpreter and compiled
on a GPU).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Union

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import LSE_FLOOR
from .triton_common import (
    online_softmax_finish,
    online_softmax_start,
    online_softmax_step,
    store_row_values,
    transform_arguments,
    transformed_logits,
)
from .validation import NO_TRANSFORM, LogitTransform

# Triton reads TRITON_INTERPRET when a kernel is defined (below): the interpreter's tl.dot on bf16 tiles returns
# garbage (Triton 3.6), so there the tiles go to fp32 first; compiled, they stay bf16 / fp16 (the tensor cores)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GROUP_M = 8  # row tiles side by side in the grouped order (the Triton matmul tutorial's choice)


class GemmConfig(NamedTuple):
    """One launch configuration of the Triton GEMM: its output tile, its K step, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


# Launch.programs for one persistent program per SM of the device the call's operands are on, read at the call
# (`sm_count`): a count fixed in the source would be one GPU's (an H100 PCIe has 114 SMs, an H100 SXM and an H200
# 132), so a lease's pick of a persistent launch is written as this (bench/README.md, "The epilogue probe's pick")
DEVICE_SMS = "device SMs"
# What `sm_count` gives a device without SMs (the CPU, where Triton's interpreter runs the kernels): fewer programs
# than the tests' tiles, so that each walks several tiles as on a GPU (the probe's dry run times this count too)
INTERPRETER_SMS = 3


class Launch(NamedTuple):
    """How the Triton GEMM runs: `programs` persistent programs walking the tiles (a count, or DEVICE_SMS: one per SM
    of the operands' device at each call; None: one program per tile), both in the grouped order; its operands loaded
    through pointers or, with `tma`, Hopper's TMA (tensor descriptors)."""

    programs: Union[int, str, None] = None
    tma: bool = False

    def __str__(self) -> str:
        return ("grouped" if self.programs is None else f"persistent ({self.programs})") + (", TMA" if self.tma else "")


# The fused loss's config per (operand size in bytes, soft-cap) (`EpilogueRowPass`; read where used, so a test or a
# lease's pick can set it). Operand stages of (BLOCK_M + BLOCK_N) BLOCK_K items each, within an H100's 227 KiB of
# shared memory per block: bf16 / fp16 three 128x256x64 stages, 144 KiB (the probe's first config); fp32 three
# 128x128x32 ones, 96 KiB (the bf16 tile at fp32 would need 288 KiB). The soft-cap's tanh in the epilogue needs more
# registers than a 128x256 tile leaves (ptxas spilled 728 bytes, sm_90, Triton 3.6): half the rows there. Pointer
# loads, one program per tile: they run on any GPU and any row length (TMA needs rows of a multiple of 16 bytes).
# Every config compiles without a spill (tests/workers/gemm_epilogue_compile_check.py); which is fastest, a lease's
# probe says (bench/gemm_epilogue_probe.py times the first).
LOSS_CONFIGS = {(2, False): GemmConfig(128, 256, 64, 8, 3), (2, True): GemmConfig(64, 256, 64, 8, 3),
                (4, False): GemmConfig(128, 128, 32, 8, 3), (4, True): GemmConfig(128, 128, 32, 8, 3)}
# The fused loss's launch, for every config (`EpilogueRowPass`; read where used, as LOSS_CONFIGS, so that a lease's
# pick can set it): one program per tile, pointer loads. A persistent one is Launch(DEVICE_SMS, ...), one program per
# SM of the device each call runs on, not the count of the GPU a lease timed. Where TMA is set and cannot load a
# chunk's operands (`tma_loads`), that chunk's GEMM uses pointer loads instead: the same products in the same K order.
LOSS_LAUNCH = Launch()


@triton.jit
def _grouped_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, vocabulary tile) of output tile number `tile` in the grouped order: GROUP_M row tiles (fewer in
    the last group) take the vocabulary tiles in turn, so that consecutive tiles share a column of W's tiles and
    a group's rows of hidden (the Triton matmul tutorial's swizzle)."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)  # drops NaN: none, tile counts are integers
    within = tile % per_group
    return first_m + within % group_rows, within // group_rows


@triton.jit
def _dot_step(a, b, acc, DOT_IN_FP32: tl.constexpr, IEEE: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] @ b [BLOCK_N, BLOCK_K].T in fp32; the tiles go to fp32 first under the interpreter
    (INTERPRETED). IEEE (fp32 operands): full fp32 products, never TF32's 10-bit mantissa (the library's fp32 path
    is fp32 throughout, as torch.mm's default)."""
    if DOT_IN_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _tile_product(hidden, weight, first_row, first_column, rows, vocab, DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                  IEEE: tl.constexpr):
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
            acc = _dot_step(hidden.load([first_row, k]), weight.load([first_column, k]), acc, DOT_IN_FP32, IEEE)
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
            acc = _dot_step(a, b, acc, DOT_IN_FP32, IEEE)
            hidden_tile += BLOCK_K
            weight_tile += BLOCK_K
    return acc


@triton.jit
def _logits_gemm_kernel(hidden, weight, bias_ptr, logits_ptr, stats_ptr, rows, vocab, logits_stride, num_programs,
                        logit_scale: tl.float32, logit_softcap: tl.float32, inv_temperature: tl.float32,
                        DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_STATS: tl.constexpr,
                        SOFTCAP: tl.constexpr, TMA: tl.constexpr, DOT_IN_FP32: tl.constexpr, IEEE: tl.constexpr,
                        _LSE_FLOOR: tl.constexpr = LSE_FLOOR):
    """logits [rows, vocab] fp32 (row stride logits_stride) := hidden [rows, DIM] @ weight [vocab, DIM].T (+ bias
    [vocab], any float dtype, added in fp32), bf16 / fp16 / fp32 operands summed in fp32; hidden and weight
    pointers, or with TMA tensor descriptors (`_tile_product`). Program p computes tiles p, p + num_programs, ... in
    the grouped order: one tile each when the grid is the tile count, a persistent walk when it is fewer (the SM
    count: `program_count`).
    With ROW_STATS, each tile's (m, s, u) per row of the transformed logits z (module docstring; the transform's
    arguments as `triton_common.transform_arguments` gives them) go to stats [rows, tiles_n, 3] fp32. LSE_FLOOR is a
    parameter with a plain number as its default, as in the library's other kernels (a global would be checked on
    every launch)."""
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(vocab, BLOCK_N)
    tile = tl.program_id(0)
    while tile < tiles_m * tiles_n:  # a run-time bound: `while`, not `range` (_tile_product's docstring)
        tile_m, tile_n = _grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_product(hidden, weight, tile_m * BLOCK_M, tile_n * BLOCK_N, rows, vocab, DIM, BLOCK_M, BLOCK_N,
                            BLOCK_K, TMA, DOT_IN_FP32, IEEE)
        row_inside = offs_m < rows
        column_inside = offs_n < vocab
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=column_inside, other=0.0).to(tl.float32)[None, :]
        tl.store(logits_ptr + offs_m.to(tl.int64)[:, None] * logits_stride + offs_n[None, :], acc,
                 mask=row_inside[:, None] & column_inside[None, :])
        if ROW_STATS:
            # the forward row kernels' own step from its start: the tile's max (never below LSE_FLOOR), s and u;
            # columns past the vocabulary are -inf after the transform (a soft-cap bounds -inf), adding nothing
            z, _ = transformed_logits(acc, logit_scale, logit_softcap, inv_temperature, SOFTCAP)
            start_max, start_sum, start_shifted = online_softmax_start(BLOCK_M, _LSE_FLOOR)
            tile_max, sum_exp, sum_exp_shifted = online_softmax_step(
                start_max, start_sum, start_shifted, tl.where(column_inside[None, :], z, float("-inf")))
            stats = stats_ptr + (offs_m.to(tl.int64) * tiles_n + tile_n) * 3
            tl.store(stats, tile_max, mask=row_inside)
            tl.store(stats + 1, sum_exp, mask=row_inside)
            tl.store(stats + 2, sum_exp_shifted, mask=row_inside)
        tile += num_programs


@triton.jit
def _combine_kernel(stats_ptr, logits_ptr, logits_stride, targets_ptr, logp_ptr, entropy_ptr, lse_ptr, tiles, vocab,
                    logit_scale: tl.float32, logit_softcap: tl.float32, inv_temperature: tl.float32,
                    SOFTCAP: tl.constexpr, TILES_BLOCK: tl.constexpr, _LSE_FLOOR: tl.constexpr = LSE_FLOOR):
    """Row r's (logp, entropy, lse) from its tiles' (m_i, s_i, u_i) in stats [rows, tiles, 3] (one program a row).

    The merge (the online softmax's, over all tiles at once): with M = max_i m_i and c_i = exp(m_i - M),
        s_i = sum_{j in i} exp(z_j - m_i)  =>  S = sum_j exp(z_j - M) = sum_i c_i s_i,
        u_i = sum_{j in i} exp(z_j - m_i)(z_j - m_i), and z_j - M = (z_j - m_i) + (m_i - M), so
        U = sum_j exp(z_j - M)(z_j - M) = sum_i c_i (u_i + (m_i - M) s_i);
    then lse = M + log S and H = -sum_j p_j log p_j = log S - U / S (`online_softmax_finish`), as the forward row
    kernel's running values give them, and logp = (z_t - M) - log S, stored as the forward row kernels store theirs
    (`triton_common.store_row_values`: at most 0, 0 for a target of -100, exactly 0 where the target holds the max
    and all the mass). z_t is the transformed target logit, read from the fp32 logits [rows, vocab] (row stride
    logits_stride; column 0 for a target outside [0, vocab), which the row checks report after this is queued).
    Padding tiles (past `tiles`) enter as m = LSE_FLOOR, s = u = 0: c_i (u_i + (m_i - M) s_i) = 0, finite."""
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, TILES_BLOCK)
    inside = index < tiles
    stats = stats_ptr + (row * tiles + index) * 3
    tile_max = tl.load(stats, mask=inside, other=_LSE_FLOOR)
    sum_exp = tl.load(stats + 1, mask=inside, other=0.0)
    sum_exp_shifted = tl.load(stats + 2, mask=inside, other=0.0)
    row_max = tl.max(tile_max, axis=0)  # drops NaN: a NaN logit's tile carries it in s and u, so in S and lse
    offset = tile_max - row_max
    scale = tl.exp(offset)
    total = tl.sum(scale * sum_exp, axis=0)
    total_shifted = tl.sum(scale * (sum_exp_shifted + offset * sum_exp), axis=0)
    log_total, entropy = online_softmax_finish(total, total_shifted)
    store_row_values(row, logits_ptr + row * logits_stride, 1, targets_ptr, logp_ptr, entropy_ptr, lse_ptr, row_max,
                     1.0, log_total, entropy, vocab, logit_scale, logit_softcap, inv_temperature, SOFTCAP, False)


def _check_operands(hidden: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor, bias) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [n, D] and weight [V, D] must share D; got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype or not (hidden.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"hidden and weight must be contiguous and of one dtype; got {hidden.dtype} and "
                         f"{weight.dtype} (contiguous: {hidden.is_contiguous()}, {weight.is_contiguous()})")
    if logits.dtype != torch.float32 or logits.shape != (hidden.shape[0], weight.shape[0]) or logits.stride(1) != 1:
        raise ValueError(f"logits must be fp32 [{hidden.shape[0]}, {weight.shape[0]}] with contiguous rows; got "
                         f"{logits.dtype} {tuple(logits.shape)}, strides {logits.stride()}")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] tensor; got {tuple(bias.shape)}, "
                         f"strides {bias.stride()}")


def tma_loads(hidden, weight) -> bool:
    """Whether Hopper's TMA can load hidden [n, D] and weight [V, D] (contiguous): rows of a multiple of 16 bytes and
    both tensors starting at a 16-byte-aligned address, as a tensor descriptor needs."""
    return all(tensor.shape[1] * tensor.element_size() % 16 == 0 and tensor.data_ptr() % 16 == 0
               for tensor in (hidden, weight))


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a CUDA device with its index: a tensor's), read once per device;
    INTERPRETER_SMS off CUDA."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def program_count(launch: Launch, device: torch.device, tiles: int) -> int:
    """The grid of `launch` over `tiles` output tiles of operands on `device`: one program per tile, or
    `launch.programs` persistent ones (`sm_count(device)` for DEVICE_SMS), never more than the tiles."""
    if launch.programs is None:
        return tiles
    programs = sm_count(device) if launch.programs == DEVICE_SMS else launch.programs
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"Launch.programs must be a count of at least 1, DEVICE_SMS or None (one program per tile); "
                         f"got {launch.programs!r}")
    return min(programs, tiles)


def tile_count(vocab: int, config: GemmConfig) -> int:
    """Vocabulary tiles of a row under `config`: the side buffer's middle dimension."""
    return triton.cdiv(vocab, config.block_n)


def logits_gemm(hidden, weight, logits, config: GemmConfig, launch: Launch = Launch(), stats=None, bias=None,
                transform: LogitTransform = NO_TRANSFORM) -> None:
    """logits [n, V] fp32 := hidden [n, D] @ weight [V, D].T (+ bias [V]) (bf16, fp16 or fp32 operands, summed in
    fp32; fp32 ones without TF32), and with `stats` ([n, tile_count(V, config), 3] fp32) each (row, vocabulary
    tile)'s (m, s, u) of the logits under `transform`, launched as `launch` says (its programs, its loads)."""
    _check_operands(hidden, weight, logits, bias)
    dim = hidden.shape[1]
    if launch.tma and not tma_loads(hidden, weight):
        raise ValueError(f"TMA loads need rows of a multiple of 16 bytes; hidden's are {dim} x {hidden.element_size()}"
                         f" bytes, and 16-byte-aligned tensors; hidden and weight start {hidden.data_ptr() % 16} and "
                         f"{weight.data_ptr() % 16} bytes past one: use a pointer launch (Launch(tma=False))")
    rows, vocab = logits.shape
    tiles = triton.cdiv(rows, config.block_m) * tile_count(vocab, config)
    if stats is not None and (stats.dtype != torch.float32 or stats.shape != (rows, tile_count(vocab, config), 3)
                              or not stats.is_contiguous()):
        raise ValueError(f"stats must be a contiguous fp32 [{rows}, {tile_count(vocab, config)}, 3] tensor for "
                         f"{config}; got {stats.dtype} {tuple(stats.shape)}")
    grid = program_count(launch, hidden.device, tiles)
    if tiles == 0:
        return
    ieee = hidden.dtype == torch.float32
    if launch.tma:
        hidden = TensorDescriptor.from_tensor(hidden, [config.block_m, config.block_k])
        weight = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    logit_scale, logit_softcap, inv_temperature, softcap = transform_arguments(transform)
    _logits_gemm_kernel[(grid,)](hidden, weight, logits if bias is None else bias, logits,
                                 logits if stats is None else stats, rows, vocab, logits.stride(0), grid,
                                 logit_scale, logit_softcap, inv_temperature, DIM=dim, BLOCK_M=config.block_m,
                                 BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=GROUP_M,
                                 HAS_BIAS=bias is not None, ROW_STATS=stats is not None, SOFTCAP=softcap,
                                 TMA=launch.tma, DOT_IN_FP32=INTERPRETED, IEEE=ieee, num_warps=config.num_warps,
                                 num_stages=config.num_stages)


def combine_stats(stats, logits, targets, out, transform: LogitTransform = NO_TRANSFORM) -> None:
    """out = (logp, entropy, lse), three [n] fp32 tensors, from stats [n, tiles, 3] fp32 (`logits_gemm`'s, made
    with `transform`), the logits [n, V] fp32 it wrote and targets [n] int64 (-100: ignored); `_combine_kernel` has
    the merge."""
    rows, tiles, _ = stats.shape
    if rows:
        _combine_kernel[(rows,)](stats, logits, logits.stride(0), targets, *out, tiles, logits.shape[1],
                                 *transform_arguments(transform), TILES_BLOCK=triton.next_power_of_2(tiles))


def loss_config(dtype: torch.dtype, transform: LogitTransform) -> GemmConfig:
    """The fused loss's GEMM config for operands of `dtype` under `transform` (LOSS_CONFIGS)."""
    key = (dtype.itemsize, transform.logit_softcap is not None)
    if key not in LOSS_CONFIGS:
        raise ValueError(f"the epilogue's logits GEMM takes bf16, fp16 or fp32 operands; got {dtype}")
    return LOSS_CONFIGS[key]


def stats_row_bytes(vocab: int, dtype: torch.dtype) -> int:
    """Bytes of one row of `EpilogueRowPass`'s side buffer for operands of `dtype`, at most (3 fp32 per vocabulary
    tile, the narrowest tile of the configs for that operand size)."""
    return max(12 * tile_count(vocab, config) for (size, _), config in LOSS_CONFIGS.items() if size == dtype.itemsize)


class EpilogueRowPass:
    """The fused loss's logits GEMM with the forward row pass in its epilogue (`fused_linear_loss.LogitsBuffer` with
    EPILOGUE_ROW_PASS): the statistics side buffer [rows, tiles, 3] fp32 beside the logits buffer's rows, filled row
    for row with the logits (`write`) and merged into the rows' (logp, entropy, lse) (`row_values`). hidden [N, D]
    and weight [V, D] (their dtype and device), bias [V] or None, under `transform`; the GEMM's config and launch
    are LOSS_CONFIGS' and LOSS_LAUNCH's when it is made."""

    def __init__(self, rows: int, hidden, weight, bias, transform: LogitTransform):
        self.config, self.launch = loss_config(hidden.dtype, transform), LOSS_LAUNCH
        self.weight, self.bias, self.transform = weight.contiguous(), bias, transform
        self.stats = hidden.new_empty(rows, tile_count(weight.shape[0], self.config), 3, dtype=torch.float32)

    def write(self, logits, hidden_rows, first: int) -> None:
        """logits [n, V] fp32 (rows first to first + n of the logits buffer) := hidden_rows [n, D] @ weight.T
        (+ bias), and the same rows of the side buffer their statistics."""
        hidden_rows = hidden_rows.contiguous()
        launch = self.launch
        if launch.tma and not tma_loads(hidden_rows, self.weight):  # LOSS_LAUNCH's comment: pointer loads instead
            launch = launch._replace(tma=False)
        logits_gemm(hidden_rows, self.weight, logits, self.config, launch,
                    stats=self.stats[first:first + hidden_rows.shape[0]], bias=self.bias, transform=self.transform)

    def row_values(self, logits, targets, out):
        """(logp, entropy, lse) [n] fp32 written into out (three contiguous [n] fp32 tensors, returned) of the logits
        buffer's first n rows, `logits` [n, V] (targets [n] int64, -100 = ignored), from the statistics that `write`
        formed for them."""
        combine_stats(self.stats[:logits.shape[0]], logits, targets, out, self.transform)
        return out
