"""Triton kernels for per-token log-probabilities and entropies on materialized logits.

One program handles one row and walks its vocabulary in blocks of BLOCK_V; every loaded logit is first transformed
into z (`triton_common.transformed_logits`: logit_scale, soft-cap, temperature):

forward  (one read of the row): the online log-sum-exp with entropy of `triton_common` (running max m,
         s = sum exp(z - m), u = sum exp(z - m) * (z - m), rescaled whenever m grows); then
         lse = m + log s, H = log s - u / s, and logp = z_target - lse. No fp32 copy of the logits is written.
backward (one read, one write): with p = exp(z - lse),
         dz_j = g_logp * (1[j == target] - p_j) - g_H * p_j * (log p_j + H),   dlogits = dz * d z / d logits,
         written straight to the output (optionally the logits buffer itself). The target entry is formed in
         fp32 as g_logp * (1 - p_t) + ..., so bf16 rounding never cancels it.

Each pass has two loops, picked by the variant (FORWARD_VARIANTS, below): the one above, and a base-2 one with the
same values (up to float rounding; exact, as the shifted loop, where the row's max holds all the mass) and about
half the instructions per logit (`_logp_entropy_forward_log2_kernel`, `_logp_entropy_backward_log2_kernel`: exp2
with log2 e and the linear transform folded into the row's constants, no mask but on the row's last block).

Offsets are int64 (row * stride and column * stride can pass 2^31 for strided views). BLOCK_V depends only on V,
and each row is reduced in a fixed order, so results are deterministic and a row's values do not depend on which
other rows share the call (batch invariance).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .common import LSE_FLOOR
from .direct_ops import DirectOp
from .triton_common import (
    clamp,
    grad_of_logits,
    online_softmax_finish,
    online_softmax_start,
    online_softmax_step,
    store_row_values,
    transform_arguments,
    transformed_logits,
)
from .triton_objective import aligned_length, as_fp32, node_row_regions, objective_row_gradients
from .validation import NO_TRANSFORM, LogitTransform


@triton.jit
def _logp_entropy_forward_kernel(
    logits_ptr, stride_row, stride_col, targets_ptr, logp_ptr, entropy_ptr, lse_ptr,
    vocab_size, logit_scale: tl.float32, logit_softcap: tl.float32, inv_temperature: tl.float32,
    SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, _LSE_FLOOR: tl.constexpr = LSE_FLOOR,
):
    """The shifted loop's forward (module docstring). LSE_FLOOR is a parameter with a plain number as its default,
    not a global, as in `_logp_entropy_forward_log2_kernel`: no global value to check per launch."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    # The row as a [1, BLOCK_V] tile of `triton_common`'s online softmax, which works on [rows, columns] tiles.
    running_max, sum_exp, sum_exp_shifted = online_softmax_start(1, _LSE_FLOOR)
    start = 0
    while start < vocab_size:  # triton_common's note on loop bounds
        cols = start + tl.arange(0, BLOCK_V)
        logits = tl.load(row_ptr + cols.to(tl.int64) * stride_col, mask=cols < vocab_size, other=0.0)
        z, _ = transformed_logits(logits.to(tl.float32)[None, :], logit_scale, logit_softcap, inv_temperature,
                                  SOFTCAP)
        z = tl.where(cols[None, :] < vocab_size, z, -float("inf"))  # after the transform (a soft-cap bounds -inf)
        running_max, sum_exp, sum_exp_shifted = online_softmax_step(running_max, sum_exp, sum_exp_shifted, z)
        start += BLOCK_V
    row_max = tl.sum(running_max, axis=0)  # [1] -> scalars
    log_sum_exp, entropy = online_softmax_finish(tl.sum(sum_exp, axis=0), tl.sum(sum_exp_shifted, axis=0))
    store_row_values(row, row_ptr, stride_col, targets_ptr, logp_ptr, entropy_ptr, lse_ptr, row_max, 1.0,
                     log_sum_exp, entropy, vocab_size, logit_scale, logit_softcap, inv_temperature, SOFTCAP, False)


# the log2 kernels' constants, the defaults of their parameters (`_logp_entropy_forward_log2_kernel`)
_FAR_BELOW = -1.0e30  # below any logit, and finite times any k < 3e8
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _fold_block_log2(x, running_max, sum_exp, sum_exp_shift, k, FAR_BELOW: tl.constexpr, LSE_FLOOR: tl.constexpr):
    """The online log-sum-exp with entropy of `triton_common`, in base 2, for a block x [BLOCK_V] fp32 of the row in
    units where z = x * (k / log2 e) (k > 0): a_j = (x_j - m) k = (z_j - m_z) log2 e, e_j = 2^a_j = exp(z_j - m_z);
    sum_exp s = sum e_j, sum_exp_shift u = sum e_j a_j. One max, one subtraction, one multiply and one exp2 per
    logit for a, one add and one FMA for s and u; the block's max, s and u reduce within the warp. A larger max
    rescales both once per block: with d = (m_old - m_new) k, s <- 2^d s and u <- 2^d (u + d s). m_old - m_new is
    floored at FAR_BELOW (the kernel's _FAR_BELOW; LSE_FLOOR its _LSE_FLOOR) before the multiply by k, which keeps d
    finite while the row has only seen -inf (m_old is then LSE_FLOOR) and gives 2^d = 0 all the same."""
    new_max = tl.maximum(running_max, tl.max(x, axis=0))  # drops NaN: a NaN logit's e = 2^a below carries it
    shift = tl.maximum(running_max - new_max, FAR_BELOW) * k  # drops NaN: none here, both maxes skip NaN
    scale = tl.exp2(shift)
    # x - m first, exactly 0 at the max: there a = 0 and e = 1, so a row whose max holds all the mass sums to s = 1
    # and u = 0, entropy 0. As x * k - m * k the GPU forms a in one FMA, whose
    # rounding of m * k leaves the max's a at +-ulp(m k) / 2: the H200 gave such a row entropy -7.3e-8, and at
    # lse ~ 1000 a logp 6.1e-5 off (2026-11-26). x <= m: a <= 0, -inf for x = -inf.
    a = (x - new_max) * k
    e = tl.exp2(a)
    # e a is 0 where e is (x = -inf gives a = -inf: 0 * -inf), so a is floored first; a NaN stays NaN through e
    sum_exp_shift = scale * (sum_exp_shift + shift * sum_exp) + tl.sum(e * clamp(a, LSE_FLOOR, None), axis=0)
    sum_exp = scale * sum_exp + tl.sum(e, axis=0)
    return new_max, sum_exp, sum_exp_shift


@triton.jit
def _logp_entropy_forward_log2_kernel(
    logits_ptr, stride_row, stride_col, targets_ptr, logp_ptr, entropy_ptr, lse_ptr,
    vocab_size, logit_scale: tl.float32, logit_softcap: tl.float32, inv_temperature: tl.float32,
    SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, _LSE_FLOOR: tl.constexpr = LSE_FLOOR,
    _FAR_BELOW: tl.constexpr = _FAR_BELOW, _LOG2E: tl.constexpr = _LOG2E, _LN2: tl.constexpr = _LN2,
):
    """`_logp_entropy_forward_kernel`'s results with fewer instructions per logit (a bf16 logit is 2 bytes: at the
    H200's 4.8 TB/s one SM gets ~9 logits a cycle, so a loop of ~12 instructions a logit is issue-bound):
    `_fold_block_log2` on the raw logits when there is no soft-cap (the linear transform's factor folded into k,
    no multiply per logit), the blocks that lie inside the row loaded without a mask and only the last one with it.
    Its constants are parameters with plain numbers as defaults (a launch passes none of them), not globals read in
    the kernel: a compiled kernel checks the value of each global it reads, its helpers' too, on every launch
    (`triton_row_checks`' note)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    if SOFTCAP:
        unit = 1.0  # x is z, transformed per logit
    else:
        unit = logit_scale * inv_temperature  # z = x * unit
    k = unit * _LOG2E
    running_max = _LSE_FLOOR + 0.0
    sum_exp = 0.0
    sum_exp_shift = 0.0
    offsets = tl.arange(0, BLOCK_V)
    inside_end = vocab_size - vocab_size % BLOCK_V
    start = 0
    while start < inside_end:  # triton_common's note on loop bounds
        x = tl.load(row_ptr + (start + offsets).to(tl.int64) * stride_col).to(tl.float32)
        if SOFTCAP:
            x, _ = transformed_logits(x, logit_scale, logit_softcap, inv_temperature, SOFTCAP)
        running_max, sum_exp, sum_exp_shift = _fold_block_log2(x, running_max, sum_exp, sum_exp_shift, k,
                                                               _FAR_BELOW, _LSE_FLOOR)
        start += BLOCK_V
    if inside_end < vocab_size:
        cols = inside_end + offsets
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_col, mask=cols < vocab_size, other=0.0).to(tl.float32)
        if SOFTCAP:
            x, _ = transformed_logits(x, logit_scale, logit_softcap, inv_temperature, SOFTCAP)
        x = tl.where(cols < vocab_size, x, -float("inf"))
        running_max, sum_exp, sum_exp_shift = _fold_block_log2(x, running_max, sum_exp, sum_exp_shift, k,
                                                               _FAR_BELOW, _LSE_FLOOR)
    # the max floored, which keeps max * unit finite on a row of -inf (lse = -inf either way)
    row_max = tl.maximum(running_max, _FAR_BELOW)  # drops NaN: none here, the running max skips NaN
    log_sum_exp = tl.log(sum_exp)
    store_row_values(row, row_ptr, stride_col, targets_ptr, logp_ptr, entropy_ptr, lse_ptr, row_max, unit,
                     log_sum_exp, log_sum_exp - sum_exp_shift * _LN2 / sum_exp, vocab_size, logit_scale,
                     logit_softcap, inv_temperature, SOFTCAP, not SOFTCAP)


@triton.jit
def _given_gradients(row, target, grad_logp_ptr, grad_entropy_ptr):
    """(g_logp, g_H) of one row as given (the two ops, the fused path), g_logp 0 on an ignored row."""
    return tl.where(target != -100, tl.load(grad_logp_ptr + row), 0.0), tl.load(grad_entropy_ptr + row)


@triton.jit
def _node_row_values(row, target, workspace_ptr, row_stride, kind_ptr, scales_ptr, grad_loss_ptr):
    """(lse, entropy, g_logp, g_H) of one row of the loss as one autograd node (`triton_logits_loss`): lse and
    entropy from the node's workspace (`triton_objective.node_row_regions`), the gradients formed from the
    objective's coefficients there as its gradient kernel forms them (`objective_row_gradients`: the same
    operations, the same values), g_logp 0 on an ignored row."""
    _, entropy_ptr, lse_ptr, coef_logp_ptr, coef_entropy_ptr = node_row_regions(workspace_ptr, row_stride)
    g_logp, g_entropy = objective_row_gradients(tl.load(kind_ptr + row), tl.load(coef_logp_ptr + row),
                                                tl.load(coef_entropy_ptr + row), scales_ptr, grad_loss_ptr)
    return tl.load(lse_ptr + row), tl.load(entropy_ptr + row), tl.where(target != -100, g_logp, 0.0), g_entropy


@triton.jit
def _dlogits_row(row_ptr, stride_col, grad_row_ptr, grad_stride_col, target, lse, entropy, g_logp, g_entropy,
                 vocab_size, logit_scale, logit_softcap, inv_temperature, SOFTCAP: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    """The shifted loop's d logits of one row (module docstring) into grad_row_ptr, from its lse, entropy and
    gradients."""
    # A row that receives no gradient gets zeros (grad_of_logits) and its logits are not even read.
    read_limit = tl.where((g_logp != 0) | (g_entropy != 0), vocab_size, 0)
    start = 0
    while start < vocab_size:  # triton_common's note on loop bounds
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab_size
        logits = tl.load(row_ptr + cols.to(tl.int64) * stride_col, mask=cols < read_limit, other=0.0)
        z, slope = transformed_logits(logits.to(tl.float32), logit_scale, logit_softcap, inv_temperature, SOFTCAP)
        grad = grad_of_logits(z, lse, entropy, g_logp, g_entropy, cols == target, slope)
        tl.store(grad_row_ptr + cols.to(tl.int64) * grad_stride_col, grad.to(grad_row_ptr.dtype.element_ty),
                 mask=mask)
        start += BLOCK_V


@triton.jit
def _logp_entropy_backward_kernel(
    logits_ptr, stride_row, stride_col, grad_ptr, grad_stride_row, grad_stride_col,
    targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    vocab_size, logit_scale: tl.float32, logit_softcap: tl.float32, inv_temperature: tl.float32,
    SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    g_logp, g_entropy = _given_gradients(row, target, grad_logp_ptr, grad_entropy_ptr)
    _dlogits_row(logits_ptr + row * stride_row, stride_col, grad_ptr + row * grad_stride_row, grad_stride_col,
                 target, tl.load(lse_ptr + row), tl.load(entropy_ptr + row), g_logp, g_entropy, vocab_size,
                 logit_scale, logit_softcap, inv_temperature, SOFTCAP, BLOCK_V)


@triton.jit
def _node_backward_kernel(
    logits_ptr, stride_row, stride_col, grad_ptr, grad_stride_row, grad_stride_col,
    targets_ptr, workspace_ptr, row_stride, kind_ptr, scales_ptr, grad_loss_ptr,
    vocab_size, logit_scale: tl.float32, logit_softcap: tl.float32, inv_temperature: tl.float32,
    SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """`_logp_entropy_backward_kernel` for the loss as one autograd node: lse, entropy and the objective's
    coefficients read from its workspace, one pointer (`_node_row_values`)."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    lse, entropy, g_logp, g_entropy = _node_row_values(row, target, workspace_ptr, row_stride, kind_ptr, scales_ptr,
                                                       grad_loss_ptr)
    _dlogits_row(logits_ptr + row * stride_row, stride_col, grad_ptr + row * grad_stride_row, grad_stride_col,
                 target, lse, entropy, g_logp, g_entropy, vocab_size, logit_scale, logit_softcap, inv_temperature,
                 SOFTCAP, BLOCK_V)


@triton.jit
def _dlogits_block(x, is_target, lse, c, g_logp, g_entropy, unit, logit_scale, logit_softcap, inv_temperature,
                   SOFTCAP: tl.constexpr, LOG2E: tl.constexpr, FAR_BELOW: tl.constexpr):
    """d logits of a block x [BLOCK_V] fp32 of logits, c = g_logp + g_H H (`_dlogits_row_log2`, whose LOG2E and
    FAR_BELOW are its kernel's _LOG2E and _FAR_BELOW)."""
    if SOFTCAP:
        z, slope = transformed_logits(x, logit_scale, logit_softcap, inv_temperature, SOFTCAP)
        log_p = z - lse
        p = tl.exp2(log_p * LOG2E)
        # log p floored: a -inf logit gives p = 0 times a finite factor, 0 (not 0 * inf)
        grad = -p * (c + g_entropy * clamp(log_p, FAR_BELOW, None))
        return tl.where(is_target, grad + g_logp, grad) * slope
    else:
        log_p = x * unit - lse
        p = tl.exp2(x * (unit * LOG2E) - lse * LOG2E)
        grad = -p * (c * unit + (g_entropy * unit) * clamp(log_p, FAR_BELOW, None))
        return tl.where(is_target, grad + g_logp * unit, grad)


@triton.jit
def _dlogits_row_log2(row_ptr, stride_col, grad_row_ptr, grad_stride_col, target, lse, entropy, g_logp, g_entropy,
                      vocab_size, logit_scale, logit_softcap, inv_temperature, SOFTCAP: tl.constexpr,
                      BLOCK_V: tl.constexpr, LOG2E: tl.constexpr, FAR_BELOW: tl.constexpr):
    """`_dlogits_row`'s d logits in about half the instructions per logit (a logit's 4 bytes, read and written, leave
    about 28 at the H200's bandwidth; `grad_of_logits` takes about 26). With p_j = 2^((z_j - lse) log2 e) and
    c = g_logp + g_H H (a constant of the row), grad_of_logits' dz_j is
        dz_j = -p_j (c + g_H log p_j) + [j = t] g_logp,
    and without the soft-cap d z / d logits = u = logit_scale / temperature is folded into the row's constants:
    dlogits_j = -p_j (u c + u g_H log p_j) + [j = t] u g_logp, with p_j and log p_j one FMA each from the raw logit.
    A row that receives no gradient is written zeros without reading its logits; the blocks inside the row are
    loaded without a mask and only the last one with it."""
    unit = logit_scale * inv_temperature  # d z / d logits without the soft-cap
    c = g_logp + g_entropy * entropy
    offsets = tl.arange(0, BLOCK_V)
    inside_end = vocab_size - vocab_size % BLOCK_V
    if (g_logp != 0) | (g_entropy != 0):
        start = 0
        while start < inside_end:  # triton_common's note on loop bounds
            cols = start + offsets
            x = tl.load(row_ptr + cols.to(tl.int64) * stride_col).to(tl.float32)
            grad = _dlogits_block(x, cols == target, lse, c, g_logp, g_entropy, unit, logit_scale, logit_softcap,
                                  inv_temperature, SOFTCAP, LOG2E, FAR_BELOW)
            tl.store(grad_row_ptr + cols.to(tl.int64) * grad_stride_col, grad.to(grad_row_ptr.dtype.element_ty))
            start += BLOCK_V
        cols = inside_end + offsets
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_col, mask=cols < vocab_size, other=0.0).to(tl.float32)
        grad = _dlogits_block(x, cols == target, lse, c, g_logp, g_entropy, unit, logit_scale, logit_softcap,
                              inv_temperature, SOFTCAP, LOG2E, FAR_BELOW)
        tl.store(grad_row_ptr + cols.to(tl.int64) * grad_stride_col, grad.to(grad_row_ptr.dtype.element_ty),
                 mask=cols < vocab_size)
    else:
        start = 0
        while start < vocab_size:
            cols = start + offsets
            tl.store(grad_row_ptr + cols.to(tl.int64) * grad_stride_col,
                     tl.zeros([BLOCK_V], dtype=grad_row_ptr.dtype.element_ty), mask=cols < vocab_size)
            start += BLOCK_V


@triton.jit
def _logp_entropy_backward_log2_kernel(
    logits_ptr, stride_row, stride_col, grad_ptr, grad_stride_row, grad_stride_col,
    targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    vocab_size, logit_scale: tl.float32, logit_softcap: tl.float32, inv_temperature: tl.float32,
    SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, _LOG2E: tl.constexpr = _LOG2E,
    _FAR_BELOW: tl.constexpr = _FAR_BELOW,
):
    """`_logp_entropy_backward_kernel`'s d logits by the base-2 loop (`_dlogits_row_log2`). Its constants are
    parameters with plain defaults, as the forward's (`_logp_entropy_forward_log2_kernel`)."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    g_logp, g_entropy = _given_gradients(row, target, grad_logp_ptr, grad_entropy_ptr)
    _dlogits_row_log2(logits_ptr + row * stride_row, stride_col, grad_ptr + row * grad_stride_row, grad_stride_col,
                      target, tl.load(lse_ptr + row), tl.load(entropy_ptr + row), g_logp, g_entropy, vocab_size,
                      logit_scale, logit_softcap, inv_temperature, SOFTCAP, BLOCK_V, _LOG2E, _FAR_BELOW)


@triton.jit
def _node_backward_log2_kernel(
    logits_ptr, stride_row, stride_col, grad_ptr, grad_stride_row, grad_stride_col,
    targets_ptr, workspace_ptr, row_stride, kind_ptr, scales_ptr, grad_loss_ptr,
    vocab_size, logit_scale: tl.float32, logit_softcap: tl.float32, inv_temperature: tl.float32,
    SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, _LOG2E: tl.constexpr = _LOG2E,
    _FAR_BELOW: tl.constexpr = _FAR_BELOW,
):
    """`_logp_entropy_backward_log2_kernel` for the loss as one autograd node, as `_node_backward_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    lse, entropy, g_logp, g_entropy = _node_row_values(row, target, workspace_ptr, row_stride, kind_ptr, scales_ptr,
                                                       grad_loss_ptr)
    _dlogits_row_log2(logits_ptr + row * stride_row, stride_col, grad_ptr + row * grad_stride_row, grad_stride_col,
                      target, lse, entropy, g_logp, g_entropy, vocab_size, logit_scale, logit_softcap,
                      inv_temperature, SOFTCAP, BLOCK_V, _LOG2E, _FAR_BELOW)


def block_size_for(vocab_size: int, widest: int = 4096) -> int:
    """Vocabulary block of one loop step: a function of V only (and the variant), which keeps results
    batch-invariant."""
    return min(1 << (vocab_size - 1).bit_length(), widest)  # the next power of 2 (triton's is a jit call)


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


class ForwardVariant(NamedTuple):
    """How the forward kernel walks a row: `widest` logits per loop step, `num_warps` warps per row (None: 8 for
    steps of >= 2048, else 4), and `kernel`, the loop; `backward`, the dlogits kernel that goes with it (4096-wide
    steps, 8 warps), and `node_backward`, that loop for the loss as one autograd node. Each forward step costs three
    reductions across the row's threads (max, sum exp, sum exp times shift); across warps each is a shared-memory
    exchange and a barrier, within one warp only shuffles."""

    widest: int
    num_warps: Optional[int]
    kernel: object  # a @triton.jit kernel with _logp_entropy_forward_kernel's arguments
    backward: object  # a @triton.jit kernel with _logp_entropy_backward_kernel's arguments
    node_backward: object  # the same loop with _node_backward_kernel's arguments (the loss as one autograd node)
    # the forward's registers per thread at most without the soft-cap (Triton's maxnreg; None: ptxas' choice); with
    # it the loop needs more (the cap would spill), so none is set
    max_registers: Optional[int] = None

    def launch_options(self, block_v: int, softcap: bool) -> dict:
        """The forward kernel's launch options (num_warps, maxnreg when set) for steps of block_v logits."""
        options = {"num_warps": self.num_warps or _num_warps(block_v)}
        if self.max_registers is not None and not softcap:
            options["maxnreg"] = self.max_registers
        return options


# Every variant reads each logit once (the floor's bytes); they differ in what a step costs beyond the loads. At
# V = 152064:
#   "block":     8 warps, 4096-wide steps: 38 steps, each 3 block-wide reductions (shuffles, a shared-memory exchange
#                and barriers) for 16 logits per thread.
#   "warp":      one warp per row, 2048-wide steps: 75 steps of 3 warp-shuffle reductions (no shared memory, no
#                barrier) for 64 logits per thread; rows, not threads, fill the SM (as Liger's forward).
#   "warp-1024": the same with 1024-wide steps (149 steps, 32 logits per thread), fewer registers.
#   "log2-1024", "log2-2048": one warp per row, 1024- / 2048-wide steps of `_logp_entropy_forward_log2_kernel`,
#                and `_logp_entropy_backward_log2_kernel` for the backward. "log2-1024" is held to 64 registers
#                (ptxas would take 78, allocated as 80): an SM then holds 32 rows, the most one-warp programs it
#                runs at once, so N=4096 rows fit one wave on 132 SMs (at 80 registers 25 rows an SM, 1.24 waves);
#                no spill, 10.3 instructions a logit, as at ptxas' 78.
# What a logit costs in instructions, read from ptxas' code for sm_90 (tests/workers/logits_compile_check.py, bf16,
# contiguous aligned rows as launched; 2026-11-26; not a timing): the loop over the vocabulary takes per logit
# 23.7 ("block"), 18.3 ("warp"), 19.0 ("warp-1024"), 10.3 ("log2-1024"), 9.6 ("log2-2048") SASS instructions
# (Liger 0.8.5's forward, without the entropy: 10.8), with 40, 87, 57, 64 and 150 registers (the base-2 loops took
# one instruction a logit fewer, 9.4 and 8.7, until _fold_block_log2 subtracted the max before its multiply, which
# made them exact at the max; the timings below are of that earlier loop); the backward loops
# 26.8 (`_logp_entropy_backward_kernel`; 25.8 with 30 registers, not 32, since 2026-11-27, when grad_of_logits
# selected log p before its product instead of the product after it) and 15.4 (log2; Liger's: 16.8). A bf16 logit
# is 2 bytes: at an H200's 4.8 TB/s an SM gets about 9 a cycle and issues 4 warp instructions (128 thread
# instructions) a cycle, about 14 a logit (28 in the backward, which moves 4 bytes a logit): the shifted forward loops
# are over that budget.
# Measured on one H200 (2026-11-25, commit fd4ea16, bf16, `python -m bench --n 4096,16384,65536 --budget 2
# --contenders erpo,erpo-warp,erpo-warp-1024`, in bench/gpu_check.sh's bench stage), fwd / fwd+bwd ms:
#   N=4096   block 1.15 / 2.01, warp 1.08 / 2.40, warp-1024 1.09 / 2.06
#   N=16384  block 2.57 / 5.14, warp 2.06 / 4.71, warp-1024 2.09 / 4.70
#   N=65536  block 9.34 / 19.6, warp 7.39 / 18.0, warp-1024 7.44 / 18.0
# so "warp-1024" beat "block". Then, on the same kind of machine (one H200, 2026-11-26, commit 148e4fe, bf16,
# `python -m bench --paths logits --n 16384,4096,65536 --contenders erpo,erpo-log2,erpo-log2-2048,erpo-block,liger
# --budget 1`; bench/measured/h200-2026-11-26/), fwd / fwd+bwd ms:
#   N=4096   warp-1024 0.661 / 1.335, block 0.675 / 1.328, log2-1024 0.687 / 1.490, log2-2048 0.732 / 1.220
#   N=16384  warp-1024 1.909 / 4.401, block 2.353 / 4.820, log2-1024 1.412 / 3.728, log2-2048 1.616 / 3.928
#   N=65536  warp-1024 6.969 / 17.25, block 8.755 / 18.77, log2-1024 4.667 / 14.34, log2-2048 5.355 / 15.10
# so the default is "log2-1024": 15-17% faster than "warp-1024" fwd+bwd at 16384 and 65536 (its forward at its
# bandwidth floor there), 12% slower at 4096, where "log2-2048" is the fastest.
_SHIFTED = (_logp_entropy_forward_kernel, _logp_entropy_backward_kernel, _node_backward_kernel)
_LOG2 = (_logp_entropy_forward_log2_kernel, _logp_entropy_backward_log2_kernel, _node_backward_log2_kernel)
FORWARD_VARIANTS = {"block": ForwardVariant(4096, None, *_SHIFTED), "warp": ForwardVariant(2048, 1, *_SHIFTED),
                    "warp-1024": ForwardVariant(1024, 1, *_SHIFTED),
                    "log2-1024": ForwardVariant(1024, 1, *_LOG2, max_registers=64),
                    "log2-2048": ForwardVariant(2048, 1, *_LOG2),
                    # the base-2 loop as "block" walks a row (8 warps, 4096-wide steps): for launches of few rows
                    # (the fused path's chunks of 512 fp32 rows: one warp per row leaves an H200's SMs 4 warps each)
                    "log2-block": ForwardVariant(4096, None, *_LOG2)}
DEFAULT_FORWARD_VARIANT = "log2-1024"
_forward_variant = [DEFAULT_FORWARD_VARIANT]


@contextlib.contextmanager
def forward_variant(name: str):
    """Run the logits kernels as FORWARD_VARIANTS[name] inside the block (bench's variants; process-wide): the
    forward, and the backward of the losses formed in the block, whenever it runs (outside torch.compile)."""
    if name not in FORWARD_VARIANTS:
        raise ValueError(f"forward variant must be one of {list(FORWARD_VARIANTS)}, got {name!r}")
    previous = _forward_variant[0]
    _forward_variant[0] = name
    try:
        yield
    finally:
        _forward_variant[0] = previous


def _launch_forward(logits, targets, transform: LogitTransform, variant_name: Optional[str] = None, out=None):
    """(logp, entropy, lse) [N] fp32 of logits [N, V] (targets [N] int64, -100 = ignored) by the forward kernel of
    FORWARD_VARIANTS[variant_name] (None: the process-wide one, `forward_variant`), written into `out` when given
    (three contiguous [N] fp32 tensors, returned)."""
    num_rows, vocab_size = logits.shape
    logp, entropy, lse = out if out is not None else (
        torch.empty(num_rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    variant = FORWARD_VARIANTS[variant_name or _forward_variant[0]]
    block_v = block_size_for(vocab_size, variant.widest)
    if num_rows > 0:
        variant.kernel[(num_rows,)](
            logits, logits.stride(0), logits.stride(1), targets, logp, entropy, lse,
            vocab_size, *transform_arguments(transform), BLOCK_V=block_v,
            **variant.launch_options(block_v, transform.logit_softcap is not None))
    return logp, entropy, lse


def _launch_backward(grad_logits, logits, targets, lse, entropy, grad_logp, grad_entropy, transform: LogitTransform,
                     variant_name: Optional[str] = None):
    """d logits into grad_logits [N, V] by the backward kernel of FORWARD_VARIANTS[variant_name] (None: the
    process-wide one, `forward_variant`; name the variant whose forward ran), for grad_logp, grad_entropy [N]."""
    _launch_dlogits(FORWARD_VARIANTS[variant_name or _forward_variant[0]].backward, grad_logits, logits, targets,
                    (lse, entropy, as_fp32(grad_logp), as_fp32(grad_entropy)), transform)


def _launch_node_backward(grad_logits, logits, targets, workspace: torch.Tensor, token_kind, scales, grad_loss,
                          transform: LogitTransform, variant_name: str):
    """`_launch_backward` for the loss as one autograd node (`triton_logits_loss`): lse, entropy and the objective's
    gradient coefficients read from the node's fp32 workspace (`NodeWorkspace.whole`, one pointer where they were four
    of its views: a launch binds each pointer on the host), which the kernel turns into the gradients itself with
    token_kind [N], the global factors `scales` [3] and grad_loss [] fp32."""
    _launch_dlogits(FORWARD_VARIANTS[variant_name].node_backward, grad_logits, logits, targets,
                    (workspace, aligned_length(logits.shape[0]), token_kind, scales, grad_loss), transform)


def _launch_dlogits(kernel, grad_logits, logits, targets, row_arguments: tuple, transform: LogitTransform):
    """Launch a backward kernel, a program per row, on logits [N, V] and its row arguments (those between the targets
    and V: the kernel's own)."""
    num_rows, vocab_size = logits.shape
    if num_rows > 0:
        block_v = block_size_for(vocab_size)
        kernel[(num_rows,)](logits, logits.stride(0), logits.stride(1), grad_logits, grad_logits.stride(0),
                            grad_logits.stride(1), targets, *row_arguments, vocab_size, *transform_arguments(transform),
                            BLOCK_V=block_v, num_warps=_num_warps(block_v))


# torch.library custom ops (what torch.compile sees instead of the kernels: no graph break). The LogitTransform
# travels as its three fields (temperature, logit_scale, logit_softcap or None), which an op schema accepts. The
# signatures use typing's Optional / Tuple, the forms that older torch's schema inference reads too.
OpOutputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # logp, entropy, lse


def logp_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float, logit_scale: float,
                 logit_softcap: Optional[float], inplace_backward: bool) -> OpOutputs:
    """(logits [N, V], targets [N] int64, -100 = ignored) -> (logp [N], entropy [N], lse [N]), all fp32 (nats);
    lse is not differentiable. inplace_backward: the backward writes d logits into `logits`."""
    return _launch_forward(logits, targets, LogitTransform(temperature, logit_scale, logit_softcap))


def logp_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                          grad_logp: torch.Tensor, grad_entropy: torch.Tensor, temperature: float,
                          logit_scale: float, logit_softcap: Optional[float]) -> torch.Tensor:
    """d logits [N, V] (logits' dtype) of sum(grad_logp * logp + grad_entropy * entropy); lse, entropy,
    grad_logp, grad_entropy [N]."""
    grad_logits = torch.empty_like(logits)
    _launch_backward(grad_logits, logits, targets, lse, entropy, grad_logp, grad_entropy,
                     LogitTransform(temperature, logit_scale, logit_softcap))
    return grad_logits


def logp_entropy_backward_inplace(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                                  entropy: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor,
                                  temperature: float, logit_scale: float, logit_softcap: Optional[float]) -> None:
    """`logp_entropy_backward` written into `logits` itself (each row is read before it is overwritten)."""
    _launch_backward(logits, logits, targets, lse, entropy, grad_logp, grad_entropy,
                     LogitTransform(temperature, logit_scale, logit_softcap))


logp_entropy_op = torch.library.custom_op("erpo::triton_logp_entropy", logp_entropy, mutates_args=())
logp_entropy_backward_op = torch.library.custom_op("erpo::triton_logp_entropy_backward", logp_entropy_backward,
                                                   mutates_args=())
logp_entropy_backward_inplace_op = torch.library.custom_op(
    "erpo::triton_logp_entropy_backward_inplace", logp_entropy_backward_inplace, mutates_args=("logits",))


@logp_entropy_op.register_fake
def _(logits, targets, temperature, logit_scale, logit_softcap, inplace_backward):
    return tuple(logits.new_empty(logits.shape[0], dtype=torch.float32) for _ in range(3))


@logp_entropy_backward_op.register_fake
def _(logits, targets, lse, entropy, grad_logp, grad_entropy, temperature, logit_scale, logit_softcap):
    return torch.empty_like(logits)


@logp_entropy_backward_inplace_op.register_fake
def _(logits, targets, lse, entropy, grad_logp, grad_entropy, temperature, logit_scale, logit_softcap):
    return None


def _setup_context(ctx, inputs, output):
    logits, targets, temperature, logit_scale, logit_softcap, inplace_backward = inputs
    _, entropy, lse = output
    ctx.save_for_backward(logits, targets, lse, entropy)
    ctx.transform = (temperature, logit_scale, logit_softcap)
    ctx.inplace_backward = inplace_backward
    ctx.variant = _forward_variant[0]  # the backward kernel that goes with the forward that ran
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros for lse's gradient (never read)


def _backward(ctx, grad_logp, grad_entropy, _grad_lse):
    """d logits for (grad_logp, grad_entropy) [N] (None for an output that received no gradient: zeros)."""
    logits, targets, lse, entropy = ctx.saved_tensors
    if grad_logp is None and grad_entropy is None:
        return None, None, None, None, None, None
    grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp
    grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy
    with forward_variant(ctx.variant):
        if ctx.inplace_backward:
            _logp_entropy_backward_inplace(logits, targets, lse, entropy, grad_logp, grad_entropy, *ctx.transform)
            grad_logits = overwritten(logits)
        else:
            grad_logits = _logp_entropy_backward(logits, targets, lse, entropy, grad_logp, grad_entropy,
                                                 *ctx.transform)
    return grad_logits, None, None, None, None, None


def overwritten(logits: torch.Tensor) -> torch.Tensor:
    """`logits` after an in-place backward wrote d logits into it, its version counter bumped as any in-place op's:
    autograd then refuses, with torch's own error, to read the overwritten values where it saved them (a second
    backward through the loss, another op that saved the logits), instead of computing with d logits as logits.
    Left to the op's functionalization where something traces."""
    if not torch.compiler.is_compiling():
        torch.autograd.graph.increment_version(logits)
    return logits


logp_entropy_op.register_autograd(_backward, setup_context=_setup_context)
# What the loss calls: the ops under torch.compile, their implementations outside it (`direct_ops`).
_logp_entropy = DirectOp(logp_entropy_op, logp_entropy, _setup_context, _backward)
_logp_entropy_backward = DirectOp(logp_entropy_backward_op, logp_entropy_backward)
_logp_entropy_backward_inplace = DirectOp(logp_entropy_backward_inplace_op, logp_entropy_backward_inplace)


def triton_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, transform: LogitTransform = NO_TRANSFORM,
                          inplace_backward: bool = False):
    """Triton per-token (logp [N] fp32, entropy [N] fp32) of the transformed logits; targets [N] int64 with -100
    (hard-coded in the kernels) on ignored rows.

    With inplace_backward=True the gradient is written into `logits` itself (no second [N, V] tensor);
    `logits` must then not be needed by anything else after the backward.
    """
    logp, entropy, _ = _logp_entropy(logits, targets.long().contiguous(), *transform.op_arguments(),
                                     bool(inplace_backward))
    return logp, entropy
