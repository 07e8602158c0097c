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

from .direct_ops import DirectOp
from .triton_common import (
    grad_of_logits,
    online_softmax_finish,
    online_softmax_start,
    online_softmax_step,
    transform_arguments,
    transformed_logits,
)
from .validation import NO_TRANSFORM, LogitTransform


@triton.jit
def _logp_entropy_forward_kernel(
    logits_ptr, stride_row, stride_col, targets_ptr, logp_ptr, entropy_ptr, lse_ptr,
    vocab_size, logit_scale, logit_softcap, inv_temperature, SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    # The row as a [1, BLOCK_V] tile, so the shared online-softmax helper serves here and in the fused kernel.
    running_max, sum_exp, sum_exp_shifted = online_softmax_start(1)
    start = 0
    while start < vocab_size:  # triton_common's note on loop bounds
        cols = start + tl.arange(0, BLOCK_V)
        logits = tl.load(row_ptr + cols.to(tl.int64) * stride_col, mask=cols < vocab_size, other=0.0)
        z, _ = transformed_logits(logits.to(tl.float32)[None, :], logit_scale, logit_softcap, inv_temperature,
                                  SOFTCAP)
        z = tl.where(cols[None, :] < vocab_size, z, -float("inf"))  # after the transform (a soft-cap bounds -inf)
        running_max, sum_exp, sum_exp_shifted = online_softmax_step(running_max, sum_exp, sum_exp_shifted, z)
        start += BLOCK_V
    lse, entropy = online_softmax_finish(tl.sum(running_max, axis=0), tl.sum(sum_exp, axis=0),
                                         tl.sum(sum_exp_shifted, axis=0))  # [1] -> scalars
    target = tl.load(targets_ptr + row)
    scored = target != -100
    # column 0 for an ignored row, and for a target outside [0, V): the row checks report that one after this
    # kernel is queued (api.loss_on_token_rows), so the load stays inside the row whatever the targets hold
    safe_target = tl.where((target >= 0) & (target < vocab_size), target, 0)
    z_target, _ = transformed_logits(tl.load(row_ptr + safe_target * stride_col).to(tl.float32), logit_scale,
                                     logit_softcap, inv_temperature, SOFTCAP)
    tl.store(logp_ptr + row, tl.where(scored, z_target - lse, 0.0))
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _logp_entropy_backward_kernel(
    logits_ptr, stride_row, stride_col, grad_ptr, grad_stride_row, grad_stride_col,
    targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    vocab_size, logit_scale, logit_softcap, inv_temperature, SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    grad_row_ptr = grad_ptr + row * grad_stride_row
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    g_logp = tl.where(target != -100, tl.load(grad_logp_ptr + row), 0.0)
    g_entropy = tl.load(grad_entropy_ptr + row)
    # A row that receives no gradient gets zeros (grad_of_logits) and its logits are not even read.
    read_limit = tl.where((g_logp != 0) | (g_entropy != 0), vocab_size, 0)
    start = 0
    while start < vocab_size:  # triton_common's note on loop bounds
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab_size
        logits = tl.load(row_ptr + cols.to(tl.int64) * stride_col, mask=cols < read_limit, other=0.0)
        z, slope = transformed_logits(logits.to(tl.float32), logit_scale, logit_softcap, inv_temperature, SOFTCAP)
        grad = grad_of_logits(z, lse, entropy, g_logp, g_entropy, cols == target, slope)
        tl.store(grad_row_ptr + cols.to(tl.int64) * grad_stride_col, grad.to(grad_ptr.dtype.element_ty), mask=mask)
        start += BLOCK_V


def block_size_for(vocab_size: int, widest: int = 4096) -> int:
    """Vocabulary block of one loop step: a function of V only (and the variant), which keeps results
    batch-invariant."""
    return min(1 << (vocab_size - 1).bit_length(), widest)  # the next power of 2 (triton's is a jit call)


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


class ForwardVariant(NamedTuple):
    """How the forward kernel walks a row: `widest` logits per loop step, `num_warps` warps per row (None: 8 for
    steps of >= 2048, else 4). Each step costs three reductions across the row's threads (max, sum exp, sum exp
    times shift); across warps each is a shared-memory exchange and a barrier, within one warp only shuffles."""

    widest: int
    num_warps: Optional[int]


# Every variant reads each logit once (the floor's bytes); they differ in what a step costs beyond the loads. At
# V = 152064:
#   "block":     8 warps, 4096-wide steps: 38 steps, each 3 block-wide reductions (shuffles, a shared-memory exchange
#                and barriers) for 16 logits per thread; on the H100 (2026-11-25, 7186653) the logits path's
#                fwd+bwd took 23.7 ms at N=65536 against a 19.8 ms floor, launches of the old objective included.
#   "warp":      one warp per row, 2048-wide steps: 75 steps of 3 warp-shuffle reductions (no shared memory, no
#                barrier) for 64 logits per thread; rows, not threads, fill the SM (as Liger's forward).
#   "warp-1024": the same with 1024-wide steps (149 steps, 32 logits per thread), fewer registers.
# ptxas (tests/workers/logits_compile_check.py, sm_90, bf16): 32, 143 and 64 registers per thread, no spills; at
# 143 an SM holds 14 rows' warps, 4 KiB of loads each in flight per step: above what H100's bandwidth-latency
# product asks per SM (estimated, not measured: 3.35 TB/s x ~600 ns / 132 SMs, about 15 KiB). Which is fastest
# is for the GPU to say: `python -m bench --paths logits --contenders erpo,erpo-warp,erpo-warp-1024` times them
# side by side; the default stays the measured one until then.
FORWARD_VARIANTS = {"block": ForwardVariant(4096, None), "warp": ForwardVariant(2048, 1),
                    "warp-1024": ForwardVariant(1024, 1)}
_forward_variant = ["block"]


@contextlib.contextmanager
def forward_variant(name: str):
    """Run the forward kernel as FORWARD_VARIANTS[name] inside the block (bench's variants; process-wide)."""
    if name not in FORWARD_VARIANTS:
        raise ValueError(f"forward variant must be one of {list(FORWARD_VARIANTS)}, got {name!r}")
    previous = _forward_variant[0]
    _forward_variant[0] = name
    try:
        yield
    finally:
        _forward_variant[0] = previous


def _launch_forward(logits, targets, transform: LogitTransform):
    num_rows, vocab_size = logits.shape
    logp, entropy, lse = (torch.empty(num_rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    variant = FORWARD_VARIANTS[_forward_variant[0]]
    block_v = block_size_for(vocab_size, variant.widest)
    if num_rows > 0:
        _logp_entropy_forward_kernel[(num_rows,)](
            logits, logits.stride(0), logits.stride(1), targets, logp, entropy, lse,
            vocab_size, *transform_arguments(transform), BLOCK_V=block_v,
            num_warps=variant.num_warps or _num_warps(block_v))
    return logp, entropy, lse


def _launch_backward(grad_logits, logits, targets, lse, entropy, grad_logp, grad_entropy, transform: LogitTransform):
    num_rows, vocab_size = logits.shape
    block_v = block_size_for(vocab_size)
    if num_rows > 0:
        _logp_entropy_backward_kernel[(num_rows,)](
            logits, logits.stride(0), logits.stride(1), grad_logits, grad_logits.stride(0), grad_logits.stride(1),
            targets, lse, entropy, grad_logp.float().contiguous(), grad_entropy.float().contiguous(),
            vocab_size, *transform_arguments(transform), BLOCK_V=block_v, num_warps=_num_warps(block_v))


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
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros for lse's gradient (never read)


def _backward(ctx, grad_logp, grad_entropy, _grad_lse):
    """d logits for (grad_logp, grad_entropy) [N] (None for an output that received no gradient: zeros)."""
    logits, targets, lse, entropy = ctx.saved_tensors
    if grad_logp is None and grad_entropy is None:
        return None, None, None, None, None, None
    grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp
    grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy
    if ctx.inplace_backward:
        _logp_entropy_backward_inplace(logits, targets, lse, entropy, grad_logp, grad_entropy, *ctx.transform)
        grad_logits = logits
    else:
        grad_logits = _logp_entropy_backward(logits, targets, lse, entropy, grad_logp, grad_entropy, *ctx.transform)
    return grad_logits, None, None, None, None, None


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
