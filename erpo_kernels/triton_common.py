"""@triton.jit helpers shared by every Triton kernel: a NaN-propagating clamp, the logit transform (and its host-side
arguments), a row's (logp, entropy, lse) stores, the online log-sum-exp with entropy, and dlogits.

The online log-sum-exp follows `common`'s docstring (the torch side): running_max m starts at the finite
LSE_FLOOR, logits outside the row are -inf, sum_exp s = sum exp(z - m), sum_exp_shifted u = sum exp(z - m)(z - m),
lse = m + log s and H = log s - u / s.

Loop bounds: a loop over a bound known only at run time (the vocabulary, a sample's rows) is a `while` loop, never
`for ... in range(start, stop, BLOCK)`. Triton's interpreter (3.6) holds every scalar as a 1-element numpy array and
`range` takes int() of it, which numpy deprecated in 1.25 and refuses from 2.4 (TypeError: only 0-dimensional arrays
can be converted to Python scalars; triton-lang/triton#9171), so no such kernel ran under TRITON_INTERPRET=1 with
numpy 2.5; a `while` condition takes bool(), which numpy allows. Compiled for sm_90 the two loops give the same PTX
for the logits kernels (the same vectorized loads, registers and instruction mix; neither loop is software-pipelined).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .validation import LogitTransform


def transform_arguments(transform: LogitTransform):
    """The kernels' arguments (logit_scale, logit_softcap, inv_temperature, SOFTCAP) for `transform`: SOFTCAP, a
    constexpr, compiles the soft-cap only when a cap is set (logit_softcap is then 1.0, never read)."""
    softcap = transform.logit_softcap
    return (float(transform.logit_scale), 1.0 if softcap is None else float(softcap), 1.0 / transform.temperature,
            softcap is not None)


@triton.jit
def clamp(x, low, high):
    """min(max(x, low), high) elementwise, as torch.clamp: a NaN in x (or a bound) gives NaN. low or high may be None,
    no bound on that side (torch.clamp(min=...) / clamp(max=...)). Every clamp of a data value goes through here:
    compiled Triton's tl.minimum / tl.maximum default to propagate_nan=NONE, which on the GPU returns the other
    operand for a NaN (PTX min/max.f32: a NaN log-ratio became the clamp bound, a finite Policy-KL), while the
    interpreter's numpy propagates it either way, so only a GPU run showed the difference."""
    if low is not None:
        x = tl.maximum(x, low, propagate_nan=tl.PropagateNan.ALL)
    if high is not None:
        x = tl.minimum(x, high, propagate_nan=tl.PropagateNan.ALL)
    return x


@triton.jit
def expm1_given_exp(x, e):
    """exp(x) - 1 from x and e = exp(x), without cancellation near 0 (libdevice is not in the interpreter): Kahan's
    (e - 1) x / log(e) for |x| <= 1, x itself where e rounds to 1, e - 1 beyond; +-inf and NaN as torch.expm1."""
    near_zero = (tl.abs(x) <= 1.0) & (e != 1.0)
    kahan = (e - 1.0) * (x / tl.log(tl.where(near_zero, e, 0.5)))
    return tl.where(near_zero, kahan, tl.where(e == 1.0, x, e - 1.0))


@triton.jit
def expm1(x):
    """exp(x) - 1 without cancellation near 0 (`expm1_given_exp`)."""
    return expm1_given_exp(x, tl.exp(x))


@triton.jit
def transformed_logits(logits, logit_scale, logit_softcap, inv_temperature, SOFTCAP: tl.constexpr):
    """(z, slope) for fp32 logits of any shape: z = softcap(logits * logit_scale) * inv_temperature
    (`validation.LogitTransform`, softcap(x) = c tanh(x / c) when SOFTCAP) and slope = d z / d logits (a scalar
    without the soft-cap). tanh from exp alone (libdevice is not in the interpreter), without cancellation: with
    e = exp(-2|x|), tanh|x| = -expm1(-2|x|) / (2 + expm1(-2|x|)) and 1 - tanh^2 x = 4 e / (1 + e)^2
    (`expm1_given_exp`). x = +-inf gives +-c; NaN stays NaN."""
    if SOFTCAP:
        x = logits * (logit_scale / logit_softcap)  # scalar factors folded: one multiply per logit
        y = -2.0 * tl.abs(x)
        e = tl.exp(y)
        growth = expm1_given_exp(y, e)
        capped = (logit_softcap * inv_temperature) * (-growth / (2.0 + growth))  # c tanh|x| / temperature
        # the sign by a select, the last operation: compiled, z then reaches the loops' subtraction of the row's max
        # as a float, exactly 0 at the max, not as a product fused into it (one FMA keeping the product's rounding)
        z = tl.where(x < 0, -capped, capped)
        slope = (logit_scale * inv_temperature) * (4.0 * e / ((1.0 + e) * (1.0 + e)))
    else:
        slope = logit_scale * inv_temperature
        z = logits * slope
    return z, slope


@triton.jit
def store_row_values(row, row_ptr, stride_col, targets_ptr, logp_ptr, entropy_ptr, lse_ptr, row_max, unit,
                     log_sum_exp, entropy, vocab_size, logit_scale, logit_softcap, inv_temperature,
                     SOFTCAP: tl.constexpr, RAW: tl.constexpr):
    """Store row `row`'s entropy, lse = row_max * unit + log s and logp = (v_target - row_max) * unit - log s, from
    one direct load of the target logit (row_ptr: the row's first logit, stride_col apart; any float dtype), where
    the row's values v are its logits themselves when RAW (`unit` then holds the linear transform: no soft-cap),
    else z (`transformed_logits`; unit = 1): the forward row kernels' end (triton_logits) and the epilogue GEMM's
    merge (triton_logits_gemm). logp is 0 for a target of -100. The target's difference from the max comes before
    the multiply: exactly 0 where the target holds the max, so a row whose max holds all the mass (log s = 0) gets
    logp = 0, not the rounding of a product. logp is at most 0 (v_target is one of the row's values, so
    v_target <= row_max, and s >= 1): a logp above 0 (none from these kernels' sums on the CPU) is stored as 0,
    every other value kept bit for bit."""
    target = tl.load(targets_ptr + row)
    scored = target != -100
    # column 0 for an ignored row, and for a target outside [0, V): the row checks report that one after this
    # kernel is queued (api.loss_on_token_rows), so the load stays inside the row whatever the targets hold
    safe_target = tl.where((target >= 0) & (target < vocab_size), target, 0)
    value = tl.load(row_ptr + safe_target * stride_col).to(tl.float32)
    if not RAW:
        value, _ = transformed_logits(value, logit_scale, logit_softcap, inv_temperature, SOFTCAP)
    # z through a select, as the loop's z pass through their mask: compiled, the product z = logit * slope would
    # otherwise contract with the subtraction into one FMA, logit * slope - row_max, which keeps the rounding of
    # the loop's product (not 0 at the max: 3.3 * 1.25 is not a float)
    value = tl.where(scored, value, row_max)
    logp = (value - row_max) * unit - log_sum_exp
    # the bound by a select, not `clamp`: a -0.0 (a row whose only max is the target at z = -0.0) and a NaN keep
    # their bits, where the interpreter's np.minimum(-0.0, 0.0) gives +0.0
    tl.store(logp_ptr + row, tl.where(scored, tl.where(logp > 0.0, 0.0, logp), 0.0))
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_ptr + row, row_max * unit + log_sum_exp)


@triton.jit
def online_softmax_start(BLOCK_M: tl.constexpr, LSE_FLOOR: tl.constexpr):
    """(running_max, sum_exp, sum_exp_shifted), each [BLOCK_M] fp32, before any logit is seen. LSE_FLOOR is
    `common.LSE_FLOOR`, handed down by the kernel (its parameter's default): a global read here would be checked on
    every launch of every kernel that calls this."""
    return (tl.full([BLOCK_M], LSE_FLOOR, tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
            tl.zeros([BLOCK_M], dtype=tl.float32))


@triton.jit
def online_softmax_step(running_max, sum_exp, sum_exp_shifted, z):
    """Fold the fp32 logits tile z [BLOCK_M, BLOCK_N] (-inf outside the row) into the running values, each
    [BLOCK_M] fp32; returns the new (running_max, sum_exp, sum_exp_shifted). u rescales as
    exp(m_old - m_new) (u + (m_old - m_new) s), finite because m never falls below LSE_FLOOR."""
    # m need not carry a NaN logit, and does not: tl.max skips NaN (compiled and interpreted), and on the GPU so does
    # this maximum; the NaN logit's exp(z - m) is NaN all the same, so s, u, and from them lse, H and logp are NaN
    new_max = tl.maximum(running_max, tl.max(z, axis=1))  # drops NaN: the reason above
    scale = tl.exp(running_max - new_max)
    sum_exp_shifted = scale * (sum_exp_shifted + (running_max - new_max) * sum_exp)
    sum_exp = scale * sum_exp
    shifted = z - new_max[:, None]
    e = tl.exp(shifted)
    sum_exp += tl.sum(e, axis=1)
    # e (z - m) is 0 where e is: outside the row (z = -inf) the product would be 0 * -inf, so the -inf is replaced
    # before the multiply, not after (the interpreter's numpy warns of the NaN otherwise; same result)
    sum_exp_shifted += tl.sum(e * tl.where(e > 0, shifted, 0.0), axis=1)
    return new_max, sum_exp, sum_exp_shifted


@triton.jit
def online_softmax_finish(sum_exp, sum_exp_shifted):
    """(log s, entropy) from the running sums (any shape, fp32); lse = m + log s."""
    log_sum_exp = tl.log(sum_exp)
    return log_sum_exp, log_sum_exp - sum_exp_shifted / sum_exp


@triton.jit
def grad_of_logits(z, lse, entropy, g_logp, g_entropy, is_target, slope):
    """dlogits of transformed logits z (`transformed_logits`: fp32, any shape broadcasting with the per-row lse,
    entropy, g_logp, g_entropy): dz_j = g_logp (1[j == t] - p_j) - g_H p_j (log p_j + H), returned as
    dz * slope (slope = d z / d logits). The target entry is g_logp * (1 - p_t) formed in fp32. Rows with
    g_logp = g_H = 0 get exact zeros, whatever z (no 0 * NaN from a non-finite padding row:
    common.rows_receiving_gradient)."""
    log_p = z - lse
    p = tl.exp(log_p)
    # log p is 0 where p is (p log p -> 0): selected before the product, so that a -inf logit (a masked vocabulary)
    # gives 0 * (0 + H), not 0 * -inf = NaN; a select after the product kept the NaN out of dz too, but formed it
    # (numpy's "invalid value" warning under the interpreter, which the kernel tier turns into an error)
    entropy_part = g_entropy * p * (tl.where(p > 0, log_p, 0.0) + entropy)
    dz = tl.where(is_target, g_logp * (1.0 - p), -g_logp * p) - entropy_part
    return tl.where((g_logp != 0) | (g_entropy != 0), dz * slope, 0.0)
