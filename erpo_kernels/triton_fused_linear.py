"""Triton kernels for the fused linear -> per-token log-prob / entropy pass (logits = hidden @ weight.T + bias).

No [N, V] tensor ever exists: the forward keeps every logits tile in registers, and the backward writes the
gradient of the logits to global memory one bounded block at a time.

forward  `_forward_partials_kernel`: one program owns BLOCK_M rows and one vocabulary split (a contiguous range of at
         most `split_size` ids). It walks the split in BLOCK_N tiles; each logits tile is a BLOCK_M x BLOCK_N fp32
         accumulator built with `tl.dot` over BLOCK_K slices of D (bf16/fp16 operands on tensor cores), then transformed
         (`triton_common.transformed_logits`: logit_scale, soft-cap, 1/temperature) and folded into the online
         log-sum-exp of `triton_common`: running max m, s = sum exp(z - m) and
         u = sum exp(z - m) * (z - m) (so H = log s - u / s has no cancellation). The target logit is picked out of the
         same tile, so logp = z_t - lse uses the very values that built lse (logp <= 0 by construction, no positive
         log-probs from two differently-rounded dot products). Each program writes its 4 partials per row to
         [num_splits, N] buffers, merged in a fixed order on the host side (`common.merge_partials`). The split size
         depends on V only, so a row's result never depends on N (batch invariance) and the grid has enough programs
         when N is small. The grid is 1-D (row tile fastest, so programs running together stream the same weight tiles
         through L2).
backward the gradient of logits is dz * (d z / d logits) with dz_j = g_logp (1[j == t] - p_j) - g_H p_j (log p_j + H)
         (d z / d logits = logit_scale / T, times 1 - tanh^2 under a soft-cap); the target
         entry is formed in fp32 as g_logp (1 - p_t) (no bf16 cancellation). dH = dlogits @ W needs a reduction
         over V and dW = dlogits^T @ H one over N; doing both inside one tile kernel needs float atomics (CCE's
         choice, not bitwise repeatable) or [BLOCK, D] accumulators (D is up to 8192, too big for registers).
         We instead walk the [N, V] plane in row chunks (outer) and vocabulary blocks (inner): for each block
         `_grad_logits_kernel` recomputes its logits with `tl.dot` and writes its dlogits (bf16 for bf16 inputs,
         fp32 for fp16 and fp32 inputs: fp16 would flush the tiny g p / T entries to zero), then
         `_matmul_kernel` adds dlogits @ W_block into the chunk's fp32 dH accumulator (cast to dH once, when
         the chunk's whole vocabulary is done) and dlogits^T @ H_chunk into dW[block] in dW's own dtype (each
         launch reduces over the chunk's rows in fp32; a bf16 dW is rounded once per row chunk, at most a few
         times: `backward_chunk_rows`). Every output element is owned by exactly one program per launch and
         launches run in a fixed order, so the result is deterministic (no atomics).
         Extra memory (the workspace): one [rows, block_vocab] dlogits block and one [rows, D] fp32 dH
         accumulator (none when hidden is fp32), sized together to about 1/64 of the bf16 logits (clamped to
         [BACKWARD_WORKSPACE_MIN, BACKWARD_WORKSPACE_MAX] bytes), plus O(N + V) vectors.
         The cost over the FLOP floor (3 GEMMs: recompute, dH, dW) is one write and two reads of each dlogits
         block, about 6 N V bytes in all. There is no faster non-deterministic (atomic) mode.

Autotuning (each kernel over its own candidate tiles): the forward and dlogits kernels are keyed on D and V (and on
whether a soft-cap is set: its epilogue changes the register pressure, so the best tile), never on N, so within a
process a row's log-prob does not depend on the batch it came in; the dH / dW GEMMs are keyed on D and power-of-two
buckets of their row / reduction sizes so a changing N does not re-tune every step. Two processes may still pick
different tiles (the autotuner times them), which can change the last bits of results between processes.

Offsets are int64 wherever row * stride can pass 2^31. The interpreter (TRITON_INTERPRET=1) cannot do bf16
arithmetic, so there every loaded tile is cast to fp32 (UPCAST); on GPUs bf16/fp16 tiles go to `tl.dot` as is.
For fp32 inputs `tl.dot` uses TF32 only when torch allows it (`torch.backends.cuda.matmul.allow_tf32`).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .common import merge_partials, rows_receiving_gradient
from .triton_common import (
    grad_of_logits,
    online_softmax_start,
    online_softmax_step,
    transform_arguments,
    transformed_logits,
)
from .validation import LogitTransform

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FORWARD_SPLIT_MIN = 8192  # vocabulary ids per forward split at least (a multiple of every BLOCK_N)
FORWARD_MAX_SPLITS = 32  # at most this many splits, so the partial buffers stay O(N)
BACKWARD_VOCAB_BLOCK = 4096  # vocabulary ids per backward dlogits block (the dH GEMM's reduction depth)
BACKWARD_WORKSPACE_FRACTION = 1 / 64  # backward workspace, as a fraction of the bf16 logits size N * V * 2
BACKWARD_WORKSPACE_MIN = 16 << 20  # bytes
BACKWARD_WORKSPACE_MAX = 256 << 20  # bytes
BACKWARD_MIN_CHUNK_ROWS = 256  # a row chunk is at least this (or N): the dW GEMM's reduction depth
CHUNK_ROW_MULTIPLE = 64


# Candidate tiles for H100-class GPUs (bf16 operands; the autotuner drops any that exceed shared memory for fp32).
GPU_FORWARD_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32}, num_warps=8, num_stages=3),
]
# dlogits: the forward's tile GEMM with an elementwise epilogue and a [BLOCK_M, BLOCK_N] store instead of the
# running softmax state; a candidate list of its own, so tuning one kernel never moves the other.
GPU_GRAD_LOGITS_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
]
GPU_MATMUL_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    # two warpgroups: the fp32-accumulating d hidden GEMM does not spill here (bench/RESULTS.md, registers table)
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
]
# The interpreter runs one small tile shape (masks at every edge of the test shapes; nothing to tune).
INTERPRETER_FORWARD_CONFIGS = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32})]
INTERPRETER_GRAD_LOGITS_CONFIGS = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32})]
INTERPRETER_MATMUL_CONFIGS = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2})]
FORWARD_CONFIGS = INTERPRETER_FORWARD_CONFIGS if INTERPRET else GPU_FORWARD_CONFIGS
GRAD_LOGITS_CONFIGS = INTERPRETER_GRAD_LOGITS_CONFIGS if INTERPRET else GPU_GRAD_LOGITS_CONFIGS
MATMUL_CONFIGS = INTERPRETER_MATMUL_CONFIGS if INTERPRET else GPU_MATMUL_CONFIGS


@triton.jit
def _logits_tile(hidden_ptr, stride_hn, stride_hd, weight_ptr, stride_wv, stride_wd, bias_ptr,
                 rows, row_mask, cols, col_mask, hidden_dim,
                 HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """logits = hidden[rows] @ weight[cols].T + bias[cols] (before the transform) as a [BLOCK_M, BLOCK_N] fp32 tile
    (rows/cols int64)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = hidden_ptr + rows[:, None] * stride_hn + ks[None, :] * stride_hd
    w_ptrs = weight_ptr + cols[None, :] * stride_wv + ks[:, None] * stride_wd
    for k_start in range(0, hidden_dim, BLOCK_K):
        k_mask = ks < hidden_dim - k_start
        h = tl.load(h_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K * stride_hd  # pointer increments: 64-bit, whatever the strides
        w_ptrs += BLOCK_K * stride_wd
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.autotune(configs=FORWARD_CONFIGS, key=["hidden_dim", "vocab_size", "split_size", "HAS_BIAS", "SOFTCAP"])
@triton.jit
def _forward_partials_kernel(
    hidden_ptr, stride_hn, stride_hd, weight_ptr, stride_wv, stride_wd, bias_ptr, targets_ptr,
    max_ptr, sum_exp_ptr, sum_exp_shifted_ptr, target_logit_ptr,
    num_rows, hidden_dim, vocab_size, split_size, logit_scale, logit_softcap, inv_temperature, SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_row_tiles = (num_rows + BLOCK_M - 1) // BLOCK_M
    row_tile = pid % num_row_tiles
    split = pid // num_row_tiles
    rows = row_tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-100)
    vocab_start = split * split_size
    vocab_end = tl.minimum(vocab_start + split_size, vocab_size)
    running_max, sum_exp, sum_exp_shifted = online_softmax_start(BLOCK_M)
    target_logit = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n_start in range(vocab_start, vocab_end, BLOCK_N):
        cols = (n_start + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_mask = cols < vocab_end
        logits = _logits_tile(hidden_ptr, stride_hn, stride_hd, weight_ptr, stride_wv, stride_wd, bias_ptr,
                              rows, row_mask, cols, col_mask, hidden_dim,
                              HAS_BIAS, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        z, _ = transformed_logits(logits, logit_scale, logit_softcap, inv_temperature, SOFTCAP)
        z = tl.where(col_mask[None, :], z, -float("inf"))
        running_max, sum_exp, sum_exp_shifted = online_softmax_step(running_max, sum_exp, sum_exp_shifted, z)
        target_logit += tl.sum(tl.where(cols[None, :] == targets[:, None], z, 0.0), axis=1)
    out = split.to(tl.int64) * num_rows + rows
    tl.store(max_ptr + out, running_max, mask=row_mask)
    tl.store(sum_exp_ptr + out, sum_exp, mask=row_mask)
    tl.store(sum_exp_shifted_ptr + out, sum_exp_shifted, mask=row_mask)
    tl.store(target_logit_ptr + out, target_logit, mask=row_mask)


@triton.autotune(configs=GRAD_LOGITS_CONFIGS, key=["hidden_dim", "block_cols", "HAS_BIAS", "SOFTCAP"])
@triton.jit
def _grad_logits_kernel(
    hidden_ptr, stride_hn, stride_hd, weight_ptr, stride_wv, stride_wd, bias_ptr, targets_ptr,
    lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, out_ptr, stride_on, stride_ov,
    row_start, row_end, col_start, col_end, block_cols, hidden_dim, logit_scale, logit_softcap, inv_temperature,
    SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dlogits of rows [row_start, row_end) x ids [col_start, col_end), stored at out[r - row_start, c - col_start]."""
    pid = tl.program_id(0)
    num_row_tiles = (row_end - row_start + BLOCK_M - 1) // BLOCK_M
    row_tile = pid % num_row_tiles
    col_tile = pid // num_row_tiles
    local_rows = row_tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    local_cols = col_tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = row_start + local_rows
    cols = col_start + local_cols
    row_mask = rows < row_end
    col_mask = cols < col_end
    logits = _logits_tile(hidden_ptr, stride_hn, stride_hd, weight_ptr, stride_wv, stride_wd, bias_ptr,
                          rows, row_mask, cols, col_mask, hidden_dim,
                          HAS_BIAS, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    z, slope = transformed_logits(logits, logit_scale, logit_softcap, inv_temperature, SOFTCAP)
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-100)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    entropy = tl.load(entropy_ptr + rows, mask=row_mask, other=0.0)
    g_logp = tl.where(targets != -100, tl.load(grad_logp_ptr + rows, mask=row_mask, other=0.0), 0.0)
    g_entropy = tl.load(grad_entropy_ptr + rows, mask=row_mask, other=0.0)
    grad = grad_of_logits(z, lse[:, None], entropy[:, None], g_logp[:, None], g_entropy[:, None],
                          cols[None, :] == targets[:, None], slope)
    out = out_ptr + local_rows[:, None] * stride_on + local_cols[None, :] * stride_ov
    tl.store(out, grad.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.autotune(configs=MATMUL_CONFIGS, key=["N", "m_bucket", "k_bucket"], restore_value=["c_ptr"])
@triton.jit
def _matmul_kernel(
    a_ptr, stride_am, stride_ak, b_ptr, stride_bk, stride_bn, c_ptr, stride_cm, stride_cn, k_valid_ptr, M, N, K,
    m_bucket, k_bucket,  # autotuning keys only: M and K rounded up to powers of two (they follow the row count)
    ACCUMULATE: tl.constexpr, HAS_K_VALID: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """c = a @ b (ACCUMULATE: c += a @ b), summed in fp32 and stored in c's dtype; one program per
    BLOCK_M x BLOCK_N tile of c (grouped order for L2 reuse). HAS_K_VALID: rows k of b whose k_valid[k] is 0 are
    read as zeros (whatever they hold: a NaN there must not reach c through 0 * NaN)."""
    pid = tl.program_id(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % group_m
    pid_n = (pid % group_size) // group_m
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + rn[None, :] * stride_bn
    for k_start in range(0, K, BLOCK_K):
        k_mask = ks < K - k_start
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b_k_mask = k_mask
        if HAS_K_VALID:
            b_k_mask = b_k_mask & (tl.load(k_valid_ptr + k_start + ks, mask=k_mask, other=0) != 0)
        b = tl.load(b_ptrs, mask=b_k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    mask = m_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(c, mask=mask, other=0.0).to(tl.float32)
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision for fp32 operands: IEEE unless torch allows TF32; fp16 inputs meet fp32 dlogits in TF32,
    which keeps their 10-bit mantissa. (Ignored for bf16/fp16 operands.)"""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def forward_split_size(vocab_size: int) -> int:
    """Vocabulary ids per forward split: a function of V only (batch invariance), at most FORWARD_MAX_SPLITS, and a
    multiple of every forward BLOCK_N, so no tile straddles two splits (the kernel picks the target logit out of
    its tile without the column mask, which would cost registers: a target among a tile's masked ids would read
    -inf)."""
    tile = max(config.kwargs["BLOCK_N"] for config in FORWARD_CONFIGS)
    size = max(FORWARD_SPLIT_MIN, triton.cdiv(vocab_size, FORWARD_MAX_SPLITS))
    return triton.cdiv(size, tile) * tile


def triton_fused_linear_forward(hidden, weight, bias, targets, transform: LogitTransform):
    """hidden [N, D], weight [V, D], bias [V] or None, targets [N] int64 (-100 = ignored) ->
    (logp [N] fp32, entropy [N] fp32, lse [N] fp32) of transform(hidden @ weight.T + bias); logp is 0 on
    ignored rows. Nothing of size N x V is allocated."""
    num_rows, hidden_dim = hidden.shape
    vocab_size = weight.shape[0]
    bias = None if bias is None else bias.contiguous()
    split_size = forward_split_size(vocab_size)
    num_splits = triton.cdiv(vocab_size, split_size)
    partials = torch.empty(4, num_splits, num_rows, dtype=torch.float32, device=hidden.device)
    if num_rows > 0:
        def grid(meta):
            return (triton.cdiv(num_rows, meta["BLOCK_M"]) * num_splits,)

        _forward_partials_kernel[grid](
            hidden, hidden.stride(0), hidden.stride(1), weight, weight.stride(0), weight.stride(1),
            hidden if bias is None else bias, targets, partials[0], partials[1], partials[2], partials[3],
            num_rows, hidden_dim, vocab_size, split_size, *transform_arguments(transform),
            HAS_BIAS=bias is not None, UPCAST=INTERPRET, DOT_PRECISION=_dot_precision(hidden.dtype))
    return merge_partials(partials[0], partials[1], partials[2], partials[3], targets)


def _size_bucket(size: int) -> int:
    return min(triton.next_power_of_2(size), 1 << 16)


def _matmul(a, b, c, *, accumulate: bool, input_dtype: torch.dtype, k_valid=None):
    """c [M, N] = a [M, K] @ b [K, N] (accumulate: c += a @ b), any strides, summed in fp32, deterministic;
    operands of two dtypes (fp32 dlogits of fp16 inputs) are both cast to fp32 for the dot. k_valid: [K] bool,
    rows of b read as zeros where False."""
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _matmul_kernel[grid](a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1),
                         c, c.stride(0), c.stride(1), a if k_valid is None else k_valid, M, N, K,
                         _size_bucket(M), _size_bucket(K), ACCUMULATE=accumulate, HAS_K_VALID=k_valid is not None,
                         UPCAST=INTERPRET or a.dtype != b.dtype,
                         DOT_PRECISION=_dot_precision(input_dtype))


def backward_chunk_rows(num_rows: int, vocab_size: int, bytes_per_row: int) -> int:
    """Rows per backward chunk: the most whose workspace (`bytes_per_row` each: a dlogits block row plus an fp32 dH
    accumulator row) fits BACKWARD_WORKSPACE_FRACTION of the bf16 logits size N * V * 2 (clamped to
    [BACKWARD_WORKSPACE_MIN, BACKWARD_WORKSPACE_MAX] bytes), at least BACKWARD_MIN_CHUNK_ROWS; then evened out
    over the chunks and rounded up to a multiple of CHUNK_ROW_MULTIPLE, never above num_rows."""
    budget = min(max(num_rows * vocab_size * 2 * BACKWARD_WORKSPACE_FRACTION, BACKWARD_WORKSPACE_MIN),
                 BACKWARD_WORKSPACE_MAX)
    rows = max(int(budget // bytes_per_row), BACKWARD_MIN_CHUNK_ROWS, 1)
    chunks = triton.cdiv(num_rows, rows)
    even = triton.cdiv(num_rows, chunks)
    return max(1, min(num_rows, triton.cdiv(even, CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE))


def triton_fused_linear_backward(hidden, weight, bias, targets, transform: LogitTransform, lse, entropy,
                                 grad_logp, grad_entropy, needs_hidden: bool, needs_weight: bool, needs_bias: bool):
    """Gradients (d hidden [N, D], d weight [V, D], d bias [V]) of sum(grad_logp * logp + grad_entropy * entropy);
    each is None when not needed. Deterministic; see the module docstring for the scheme and its workspace."""
    num_rows, hidden_dim = hidden.shape
    vocab_size = weight.shape[0]
    bias = None if bias is None else bias.contiguous()
    device = hidden.device
    if num_rows == 0:
        return (torch.zeros_like(hidden) if needs_hidden else None,
                torch.zeros_like(weight) if needs_weight else None,
                torch.zeros_like(bias) if needs_bias else None)
    # dlogits are as small as g * p / T (g ~ 1 / tokens): fp16 would flush them to zero, bf16 / fp32 keep them.
    block_dtype = torch.float32 if hidden.dtype == torch.float16 else hidden.dtype
    block_vocab = min(vocab_size, BACKWARD_VOCAB_BLOCK)
    hidden_in_place = hidden.dtype == torch.float32  # dH accumulates in its own fp32 rows
    bytes_per_row = block_vocab * block_dtype.itemsize + (0 if hidden_in_place or not needs_hidden else 4 * hidden_dim)
    chunk_rows = backward_chunk_rows(num_rows, vocab_size, bytes_per_row)
    grad_hidden = torch.empty_like(hidden) if needs_hidden else None
    hidden_accumulator = (torch.empty(chunk_rows, hidden_dim, dtype=torch.float32, device=device)
                          if needs_hidden and not hidden_in_place else None)
    grad_weight = torch.empty_like(weight) if needs_weight else None
    bias_accumulator = torch.zeros(vocab_size, dtype=torch.float32, device=device) if needs_bias else None
    block = torch.empty(chunk_rows, block_vocab, dtype=block_dtype, device=device)
    # Rows that receive no gradient have zero dlogits (grad_of_logits); d weight also reads their hidden rows as 0.
    receives_gradient = rows_receiving_gradient(targets, grad_logp, grad_entropy).to(torch.int8)
    for row_start in range(0, num_rows, chunk_rows):
        row_end = min(row_start + chunk_rows, num_rows)
        rows = row_end - row_start
        chunk_grad_hidden = None
        if needs_hidden:
            chunk_grad_hidden = grad_hidden[row_start:row_end] if hidden_in_place else hidden_accumulator[:rows]
        for col_start in range(0, vocab_size, block_vocab):
            col_end = min(col_start + block_vocab, vocab_size)
            cols = col_end - col_start
            dlogits = block[:rows, :cols]

            def grid(meta, rows=rows, cols=cols):
                return (triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(cols, meta["BLOCK_N"]),)

            _grad_logits_kernel[grid](
                hidden, hidden.stride(0), hidden.stride(1), weight, weight.stride(0), weight.stride(1),
                hidden if bias is None else bias, targets, lse, entropy, grad_logp, grad_entropy,
                dlogits, dlogits.stride(0), dlogits.stride(1), row_start, row_end, col_start, col_end, cols,
                hidden_dim, *transform_arguments(transform),
                HAS_BIAS=bias is not None, UPCAST=INTERPRET, DOT_PRECISION=_dot_precision(hidden.dtype))
            if needs_hidden:
                _matmul(dlogits, weight[col_start:col_end], chunk_grad_hidden, accumulate=col_start > 0,
                        input_dtype=hidden.dtype)
            if needs_weight:
                _matmul(dlogits.t(), hidden[row_start:row_end], grad_weight[col_start:col_end],
                        accumulate=row_start > 0, input_dtype=hidden.dtype,
                        k_valid=receives_gradient[row_start:row_end])
            if needs_bias:
                bias_accumulator[col_start:col_end] += dlogits.sum(0, dtype=torch.float32)
        if needs_hidden and not hidden_in_place:
            grad_hidden[row_start:row_end] = chunk_grad_hidden
    grad_bias = bias_accumulator.to(bias.dtype) if needs_bias else None
    return grad_hidden, grad_weight, grad_bias
