"""The ERPO objective on per-token vectors in three Triton kernels: `objective.erpo_objective`'s loss, metrics and
gradient, for the options trainers use most, without an autograd graph over dozens of eager ops.

    forward   1. one program per sample s walks its rows twice, in a fixed order (row order over the sample's
                 span, `triton_segment.sample_spans`, as `triton_segment`'s sums: no sort): first the sums the
                 sample's terms need (ell_theta(q_s), the response rows' count, the sum of their log-ratios for
                 the sequence-level ratio, of their weights and Policy-KLs for the sequence-level gradient, of the
                 drift behind the off-policy mask, of VESPO's log-weights, of the query rows' k3 for "k3-token"),
                 then every response row's term_t and the sample's partial sums (loss, metrics); it writes each
                 row's gradient coefficients, up to one global factor
              2. one program reduces the [S, P] partials in a fixed order: loss, metrics, and the global factors
                 (the aggregation's denominator, the Query-KL's, the token-mean entropy bonus's); for the one-node
                 loss (`triton_logits_loss`) the last program of kernel 1 to store its partials runs it, in the
                 same launch (`_objective_sample_finish_kernel`: one Triton launch fewer, each costing the host
                 tens of microseconds), the two ops' path and the fused path launch it apart
              Both forms are to give the same bits on a GPU too (they did not at b8b4a78, H100: the sums of a
              sample's rows differed in the last bits; not rerun on a GPU since). There tl.sum adds a [BLOCK]
              tensor's lanes in an order its layout fixes, which Triton takes from the best-aligned load of that
              shape in the whole kernel (the one-node kernel's finish loads query_logp [S] aligned); the span walks
              declare their rows aligned (`triton_segment.span_block_rows`), so kernels 1 and 2, fused or apart,
              and `triton_segment`'s sums lay out every [BLOCK] tensor alike (compiled for sm_90 as launched:
              tests/kernels/test_logits_loss_node.py)
    backward  3. d loss / d logp_t and d loss / d H_t = coefficient x global factor x grad_output, one program per
                 block of rows (`objective_row_gradients`); on the logits path `triton_logits`'s dlogits kernel
                 follows, or, the loss being one autograd node (`triton_logits_loss`), forms them itself

The gradient coefficients, derived from the reference's equations (API.md's math; sg = detached):
    response row t of sample s, term_t = w_s tw_t rho_t pg_t + beta KL_t - c_H H_t, aggregated with factor
    lam_s G (G = 1 / num_items or 1 / num_seqs; lam_s = 1 / |R_s| for seq-mean-token-mean, else 1):
        d pg_t / d logp_t    = pg'(ratio) ratio [|log ratio| <= pg_log_ratio_clamp]           (token level)
        d pg_t / d logp_u    = pg'(ratio_s) ratio_s [|mean log ratio| <= clamp] / |R_s|          (sequence level,
                               every response row u of s: a per-sample sum over t of w_s tw_t rho_t times it)
        pg'(r)               = -A_s (unclipped branch) or -A_s [1 - clip_low <= r <= 1 + clip_high] (clipped),
                               times the dual clip's min; ties split the gradient in halves as torch.maximum's
                               (ppo-clip); -4 A_s sigmoid (1 - sigmoid) (sapo); 0 for cispo and vespo, whose
                               weight is detached: their pg_t = -c_t A_s logp_t adds d pg_t / d logp_t = -c_t A_s
                               (c_t = min(ratio, cispo_clip_max), or phi(w_s)); `_policy_surrogate`
        w_s includes the off-policy mask (0 or 1 per sample); with vespo rho_t is folded into w_s, not into pg_t
        d KL_t / d logp_t    = -expm1(x_t) [|x_t| <= log_ratio_clamp] [|k3| <= kl_clamp],  x_t = ref_t - logp_t;
                               with the bias correction KL_t = ratio k3_t adds k3 d ratio / d logp
    query row t of sample s:  qkl_coef / num_query_seqs * (-f'(r_s)) [|f| <= kl_clamp],  r_s = ref_q_s - q_s, f'(r)
                               = k'(clamp(r, +-qkl_linear_beyond)) (`objective.linear_beyond`); "k3-token":
                               qkl_coef / num_query_seqs / |Q_s| * d k3_t / d logp_t (as d KL_t above)
    d loss / d H_t = -c_H lam_s G (entropy_agg "loss-agg") or -c_H / |R| ("token-mean").

Options fused here (`fuses`): every pg_objective (ppo-clip, cispo, sapo, vespo) at token and sequence level, every
loss_agg, the Query-KL's k1 / k2 / k3 / k3-token, the Policy-KL with and without bias correction, kl_clamp,
pg_log_ratio_clamp, dual_clip, the off-policy mask, the entropy bonus in both aggregations, query_weight,
token_weight, rollout_logp with or without rollout_is_cap, num_items / num_seqs (numbers or tensors), the entropy
filter (top_entropy_quantile: its threshold computed first, `triton_quantile`). The others (the entropy filter
across processes (top_entropy_gather), or without entropies; fp64 log-probs) run the reference objective on the
[N] vectors.
Counts (rows per sample, samples with rows) are summed in fp32: exact below 2^24 rows, as the reference's.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import objective
from .direct_ops import DirectOp
from .objective import LossMetrics, LossOutput
from .triton_common import clamp, expm1
from .triton_quantile import masked_quantile_op
from .triton_segment import (
    NODE_COUNTS,
    NODE_TICKET,
    SUM_BLOCK,
    first_block_start,
    span_block_rows,
    span_bounds,
    triton_sample_spans,
)
from .validation import INPUT_NAMES, LogitTransform, LossInputs, LossOptions

# Columns of the per-sample partials [S, P] (fp32) written by the sample kernel and reduced by the finish kernel.
QUERY_ROWS, RESPONSE_ROWS, QKL, TERM, PG, POLICY_KL, ENTROPY, CLIPPED, RATIO, IS_WEIGHT, GAP_ABS, GAP_MAX, \
    NONFINITE, OFF_POLICY_MASKED, VESPO_PHI, KEPT_ROWS, KEPT_ENTROPY = range(17)
NUM_PARTIALS = 17
# The fp32 metrics vector the finish kernel writes, in LossOutput.metrics' order; the int64 counts beside it.
FLOAT_METRICS = ("qkl", "policy_kl", "entropy", "clip_frac", "pg_loss", "ratio_mean", "query_logp_mean",
                 "rollout_is_weight", "rollout_logp_gap_abs", "rollout_logp_gap_max", "off_policy_masked_frac",
                 "kept_entropy", "vespo_phi_mean")
COUNT_METRICS = ("response_tokens", "nonfinite_rows", "kept_tokens")
# the counter of the sample kernel's programs that are done, with FINISH: counts' entry after COUNT_METRICS (the
# counts the spans' kernels leave beside the spans have that layout: triton_segment.NODE_COUNTS)
TICKET = NODE_TICKET
assert len(COUNT_METRICS) + 1 == NODE_COUNTS and TICKET == len(COUNT_METRICS)
QKL_ESTIMATOR_CODES = {"k1": 1, "k2": 2, "k3": 3, "k3-token": 4}
PG_OBJECTIVE_CODES = {"ppo-clip": 0, "cispo": 1, "sapo": 2, "vespo": 3}
VESPO_LOG_RATIO_CLAMP = objective.VESPO_LOG_RATIO_CLAMP  # TRL's clamps of VESPO's log-weights
VESPO_LOG_WEIGHT_MIN = objective.VESPO_LOG_WEIGHT_MIN
LOSS_AGG_CODES = {"token-mean": 0, "seq-mean-token-mean": 1, "seq-mean-token-sum": 2}
# rows per loop step of the sample kernel (the per-sample sums' step: its ell_theta(q) is bit-equal to theirs,
# `first_block_start`), and per program of the gradient kernel
ROW_BLOCK = SUM_BLOCK
SAMPLE_BLOCK = 256  # samples per loop step of the finish kernel
# Each region of the one-node loss's workspace (`NodeWorkspace`) begins at a multiple of this many elements (64
# bytes), whatever N and S: `_node_regions`.
REGION_ALIGN = 16
# The option flags of `_objective_sample_finish_kernel` (the sample kernel's and the finish kernel's constexprs of
# these names), packed into its one constexpr FLAGS: bit i is NODE_FLAGS[i] (`node_flags`; the kernel unpacks them in
# this order). One parameter instead of twenty: binding a launch's parameters is host time (`python -m
# bench.host_cost`'s binding row).
NODE_FLAGS = ("HAS_ENTROPY", "HAS_QKL_REFERENCE", "HAS_QUERY_WEIGHT", "HAS_OLD", "HAS_REF_LOGP", "HAS_TOKEN_WEIGHT",
              "HAS_ROLLOUT", "HAS_IS_CAP", "HAS_DUAL", "HAS_PG_CLAMP", "HAS_KL_CLAMP", "USE_QKL", "USE_POLICY_KL",
              "ENTROPY_IN_TERM", "SEQUENCE_RATIO", "BIAS_CORRECTION", "PER_TOKEN_MEAN", "HAS_OFF_POLICY",
              "HAS_ENTROPY_FILTER", "ENTROPY_TOKEN_MEAN")


def node_flags(flags: dict) -> int:
    """`_objective_sample_finish_kernel`'s FLAGS from {name: bool} for every name of NODE_FLAGS (a KeyError names
    one left out): bit i set where NODE_FLAGS[i] is true."""
    return sum(1 << bit for bit, name in enumerate(NODE_FLAGS) if flags[name])


def fuses(options: LossOptions, token_logp: torch.Tensor, entropy: Optional[torch.Tensor]) -> bool:
    """True when these kernels compute the objective for `options` (module docstring); else the caller runs
    `objective.erpo_objective`."""
    return (token_logp.dtype == torch.float32 and (entropy is None or entropy.dtype == torch.float32)
            and fuses_options(options, has_entropy=entropy is not None))


def fuses_options(options: LossOptions, has_entropy: bool = True) -> bool:
    """`fuses` on fp32 log-probs and entropies (or none: has_entropy=False), as the logits path's token pass gives."""
    entropy_filter = options.top_entropy_quantile < 1.0
    return not (entropy_filter and (not has_entropy or options.top_entropy_gather is not None))


@triton.jit
def _is_finite(x):
    return tl.abs(x) < float("inf")  # False for +-inf and NaN


@triton.jit
def _between(x, low, high):
    """torch.clamp's gradient mask: 1 where low <= x <= high (0 for NaN)."""
    return ((x >= low) & (x <= high)).to(tl.float32)


@triton.jit
def _kl_estimate(r, ESTIMATOR: tl.constexpr):
    """k1 = -r, k2 = r^2 / 2, k3 = expm1(r) - r (`objective.kl_estimate`)."""
    if ESTIMATOR == 1:
        return -r
    elif ESTIMATOR == 2:
        return 0.5 * r * r
    else:
        return expm1(r) - r


@triton.jit
def _kl_slope(r, ESTIMATOR: tl.constexpr):
    """d estimate / d r (`objective.kl_slope`)."""
    if ESTIMATOR == 1:
        return tl.zeros_like(r) - 1.0
    elif ESTIMATOR == 2:
        return r
    else:
        return expm1(r)


@triton.jit
def _clipped_surrogate(advantage, ratio, clip_low, clip_high, dual_clip, HAS_DUAL: tl.constexpr):
    """(pg, d pg / d ratio, clipped branch taken) of `objective.clipped_surrogate`, elementwise; ties between
    the branches split the gradient in halves, as torch.maximum / torch.minimum do."""
    unclipped = -advantage * ratio
    low = 1.0 - clip_low
    high = 1.0 + clip_high
    clipped = -advantage * clamp(ratio, low, high)
    pg = tl.where(clipped > unclipped, clipped, unclipped)
    to_unclipped = tl.where(unclipped < clipped, 0.0, tl.where(unclipped == clipped, 0.5, 1.0))
    to_clipped = tl.where(unclipped > clipped, 0.0, tl.where(unclipped == clipped, 0.5, 1.0))
    slope = -advantage * (to_unclipped + to_clipped * _between(ratio, low, high))
    if HAS_DUAL:
        cap = -advantage * dual_clip
        to_pg = tl.where(pg > cap, 0.0, tl.where(pg == cap, 0.5, 1.0))
        negative = advantage < 0
        slope = tl.where(negative, slope * to_pg, slope)
        pg = tl.where(negative, tl.where(cap < pg, cap, pg), pg)
    return pg, slope, clipped > unclipped


@triton.jit
def _policy_surrogate(advantage, ratio, logp, clip_low, clip_high, dual_clip, cispo_clip_max, sapo_temperature_pos,
                      sapo_temperature_neg, vespo_phi, PG_OBJECTIVE: tl.constexpr, HAS_DUAL: tl.constexpr):
    """(pg, d pg / d ratio, d pg / d logp at a fixed ratio, clip or truncation taken) of `objective.policy_term`'s
    pg_t for PG_OBJECTIVE (PG_OBJECTIVE_CODES), elementwise:
        ppo-clip  `_clipped_surrogate`
        cispo     -min(sg(ratio), clip_max) A logp:        d / d ratio = 0, d / d logp = -min(ratio, clip_max) A
        sapo      -A (4 / tau) sigmoid(tau (ratio - 1)):  d / d ratio = -4 A sigmoid (1 - sigmoid)
        vespo     -phi_s A logp (phi_s detached):           d / d ratio = 0, d / d logp = -phi_s A"""
    no_slope = tl.zeros_like(ratio)
    never = no_slope != 0.0  # sapo and vespo clip nothing
    if PG_OBJECTIVE == 0:
        pg, slope, clipped = _clipped_surrogate(advantage, ratio, clip_low, clip_high, dual_clip, HAS_DUAL)
        return pg, slope, no_slope, clipped
    elif PG_OBJECTIVE == 1:
        weight = clamp(ratio, None, cispo_clip_max)
        return -weight * advantage * logp, no_slope, -weight * advantage + no_slope, ratio > cispo_clip_max
    elif PG_OBJECTIVE == 2:
        tau = tl.where(advantage > 0, sapo_temperature_pos, sapo_temperature_neg)
        gate = tl.sigmoid(tau * (ratio - 1.0))
        return -advantage * gate * 4.0 / tau, -4.0 * advantage * gate * (1.0 - gate), no_slope, never
    else:
        return -vespo_phi * advantage * logp, no_slope, -vespo_phi * advantage + no_slope, never


@triton.jit
def _row_values(positions, stop, sample, order_ptr, sample_ptr, kind_ptr, logp_ptr, entropy_ptr, old_logp_ptr,
                ref_logp_ptr, token_weight_ptr, rollout_logp_ptr, log_ratio_clamp, kl_clamp, log_rollout_is_cap,
                entropy_threshold,
                HAS_ENTROPY: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF_LOGP: tl.constexpr,
                HAS_TOKEN_WEIGHT: tl.constexpr, HAS_ROLLOUT: tl.constexpr, HAS_IS_CAP: tl.constexpr,
                HAS_KL_CLAMP: tl.constexpr, WEIGHT_BY_IS: tl.constexpr, KL_ON_QUERY: tl.constexpr,
                HAS_ENTROPY_FILTER: tl.constexpr, SPANS: tl.constexpr):
    """A block of one sample's rows, `positions` < `stop`: rows order[positions], or with SPANS the rows themselves,
    those whose sample_index is `sample` (the others read as rows of kind 0). The values both passes read.
    Returns (rows, is_query, is_response, logp, entropy, token log-ratio, row weight tw_t rho_t (rho_t only with
    WEIGHT_BY_IS, and 0 where the entropy filter drops the row), rollout weight rho_t, rollout gap, k3_t,
    d k3_t / d logp_t, behaviour drift b_t - logp_t, kept, nonfinite), each [BLOCK]; 0 off the response rows (but
    logp, entropy, nonfinite, and with KL_ON_QUERY k3_t and its slope on query rows too: "k3-token"'s Query-KL).
    b_t: rollout_logp, else old_logp, else logp (the off-policy mask's). kept: the response rows the entropy filter
    keeps (H_t >= entropy_threshold; every response row without the filter)."""
    inside = positions < stop
    if SPANS:
        rows = positions
        mine = tl.load(sample_ptr + rows, mask=inside, other=-1) == sample
        kind = tl.where(mine, tl.load(kind_ptr + rows, mask=inside, other=0), 0)
    else:
        rows = tl.load(order_ptr + positions, mask=inside, other=0)
        kind = tl.load(kind_ptr + rows, mask=inside, other=0)
    is_query = kind == 1
    is_response = kind == 2
    logp = tl.load(logp_ptr + rows, mask=inside, other=0.0)
    if HAS_ENTROPY:
        entropy = tl.load(entropy_ptr + rows, mask=inside, other=0.0)
        nonfinite = (kind != 0) & ~(_is_finite(logp) & _is_finite(entropy))
    else:
        entropy = tl.zeros_like(logp)
        nonfinite = (kind != 0) & ~_is_finite(logp)
    if HAS_OLD:
        old = tl.load(old_logp_ptr + rows, mask=inside, other=0.0)
    else:
        old = logp  # on-policy: old = sg(logp), a log-ratio of 0 (NaN for a non-finite logp, as the reference)
    log_ratio = tl.where(is_response, logp - old, 0.0)
    drift = -log_ratio
    weight = tl.where(is_response, 1.0, 0.0)
    if HAS_TOKEN_WEIGHT:
        weight = tl.where(is_response, tl.load(token_weight_ptr + rows, mask=inside, other=0.0), 0.0)
    gap = tl.zeros_like(logp)
    is_weight = tl.zeros_like(logp)
    if HAS_ROLLOUT:
        rollout = tl.load(rollout_logp_ptr + rows, mask=inside, other=0.0)
        gap = tl.where(is_response, old - rollout, 0.0)
        drift = tl.where(is_response, rollout - logp, 0.0)
        if HAS_IS_CAP:
            is_weight = tl.where(is_response, tl.exp(clamp(gap, None, log_rollout_is_cap)), 0.0)
            if WEIGHT_BY_IS:
                weight = weight * is_weight
    kept = is_response
    if HAS_ENTROPY_FILTER:
        kept = is_response & (entropy >= entropy_threshold)
        weight = weight * kept.to(tl.float32)
    kl = tl.zeros_like(logp)
    kl_grad = tl.zeros_like(logp)
    if HAS_REF_LOGP:
        kl_rows = (is_response | is_query) if KL_ON_QUERY else is_response
        x = tl.where(kl_rows, tl.load(ref_logp_ptr + rows, mask=inside, other=0.0) - logp, 0.0)
        x_clamped = clamp(x, -log_ratio_clamp, log_ratio_clamp)
        growth = expm1(x_clamped)
        kl = growth - x_clamped
        kl_grad = -growth * _between(x, -log_ratio_clamp, log_ratio_clamp)
        if HAS_KL_CLAMP:
            kl_grad = kl_grad * _between(kl, -kl_clamp, kl_clamp)
            kl = clamp(kl, -kl_clamp, kl_clamp)
    return (rows, is_query, is_response, logp, entropy, log_ratio, weight, is_weight, gap, kl, kl_grad, drift, kept,
            nonfinite)


@triton.jit
def _objective_sample_kernel(
    logp_ptr, entropy_ptr, kind_ptr, order_ptr, starts_ptr, sample_ptr, sample_ids_ptr, advantages_ptr,
    ref_query_logp_ptr,
    query_weight_ptr,
    old_logp_ptr, ref_logp_ptr, token_weight_ptr, rollout_logp_ptr, entropy_threshold_ptr,
    partials_ptr, query_logp_ptr, response_logp_ptr, coef_logp_ptr, coef_entropy_ptr,
    clip_low: tl.float32, clip_high: tl.float32, dual_clip: tl.float32, pg_log_ratio_clamp: tl.float32,
    log_ratio_clamp: tl.float32, kl_clamp: tl.float32, log_rollout_is_cap: tl.float32, qkl_coef: tl.float32,
    qkl_linear_beyond: tl.float32, policy_kl_coef: tl.float32, entropy_coef: tl.float32, cispo_clip_max: tl.float32,
    sapo_temperature_pos: tl.float32, sapo_temperature_neg: tl.float32, vespo_k_pos: tl.float32,
    vespo_lambda_pos: tl.float32, vespo_k_neg: tl.float32, vespo_lambda_neg: tl.float32,
    off_policy_mask_threshold: tl.float32,
    HAS_ENTROPY: tl.constexpr, HAS_QKL_REFERENCE: tl.constexpr, HAS_QUERY_WEIGHT: tl.constexpr, HAS_OLD: tl.constexpr,
    HAS_REF_LOGP: tl.constexpr, HAS_TOKEN_WEIGHT: tl.constexpr, HAS_ROLLOUT: tl.constexpr,
    HAS_IS_CAP: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_PG_CLAMP: tl.constexpr, HAS_KL_CLAMP: tl.constexpr,
    USE_QKL: tl.constexpr, USE_POLICY_KL: tl.constexpr, ENTROPY_IN_TERM: tl.constexpr,
    SEQUENCE_RATIO: tl.constexpr, BIAS_CORRECTION: tl.constexpr, PER_TOKEN_MEAN: tl.constexpr,
    QKL_ESTIMATOR: tl.constexpr, PG_OBJECTIVE: tl.constexpr, HAS_OFF_POLICY: tl.constexpr,
    HAS_ENTROPY_FILTER: tl.constexpr, HAS_SAMPLE_IDS: tl.constexpr, SPANS: tl.constexpr,
    NUM_PARTIALS_: tl.constexpr, BLOCK: tl.constexpr, VESPO_LOG_RATIO_CLAMP: tl.constexpr = VESPO_LOG_RATIO_CLAMP,
    VESPO_LOG_WEIGHT_MIN: tl.constexpr = VESPO_LOG_WEIGHT_MIN, TICKET: tl.constexpr = TICKET,
):
    # constants as parameters with plain defaults, not globals (`_objective_sample_finish_kernel`'s note)
    _sample_objective(
        logp_ptr, entropy_ptr, kind_ptr, order_ptr, starts_ptr, sample_ptr, sample_ids_ptr, advantages_ptr,
        ref_query_logp_ptr, query_weight_ptr, old_logp_ptr, ref_logp_ptr, token_weight_ptr, rollout_logp_ptr,
        entropy_threshold_ptr, partials_ptr, query_logp_ptr, response_logp_ptr, coef_logp_ptr, coef_entropy_ptr,
        clip_low, clip_high, dual_clip, pg_log_ratio_clamp, log_ratio_clamp, kl_clamp, log_rollout_is_cap, qkl_coef,
        qkl_linear_beyond, policy_kl_coef, entropy_coef, cispo_clip_max, sapo_temperature_pos, sapo_temperature_neg,
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, off_policy_mask_threshold, HAS_ENTROPY,
        HAS_QKL_REFERENCE, HAS_QUERY_WEIGHT, HAS_OLD, HAS_REF_LOGP, HAS_TOKEN_WEIGHT, HAS_ROLLOUT, HAS_IS_CAP,
        HAS_DUAL, HAS_PG_CLAMP, HAS_KL_CLAMP, USE_QKL, USE_POLICY_KL, ENTROPY_IN_TERM, SEQUENCE_RATIO,
        BIAS_CORRECTION, PER_TOKEN_MEAN, QKL_ESTIMATOR, PG_OBJECTIVE, HAS_OFF_POLICY, HAS_ENTROPY_FILTER,
        HAS_SAMPLE_IDS, SPANS, NUM_PARTIALS_, BLOCK, None, None, None, None, None, None, 0.0, 0.0, False, 0, 0, 0,
        False, 1, VESPO_LOG_RATIO_CLAMP, VESPO_LOG_WEIGHT_MIN, TICKET)


# The scalars `_objective_sample_finish_kernel` loads from one fp32 vector (`node_scalars`), in this order: the
# sample kernel's float parameters, then the finish's numbers num_items and num_seqs.
NODE_SCALARS = ("clip_low", "clip_high", "dual_clip", "pg_log_ratio_clamp", "log_ratio_clamp", "kl_clamp",
                "log_rollout_is_cap", "qkl_coef", "qkl_linear_beyond", "policy_kl_coef", "entropy_coef",
                "cispo_clip_max", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
                "vespo_k_neg", "vespo_lambda_neg", "off_policy_mask_threshold", "num_items", "num_seqs")


@triton.jit
def _aligned_length(count, REGION_ALIGN: tl.constexpr):
    """count rounded up to a multiple of REGION_ALIGN (the kernel's, `aligned_length`'s), as the compiler is told."""
    return tl.multiple_of(tl.cdiv(count, REGION_ALIGN) * REGION_ALIGN, REGION_ALIGN)


@triton.jit
def node_row_regions(workspace_ptr, row_stride):
    """Pointers to the [N] regions of the one-node loss's fp32 workspace (`NodeWorkspace`, its first five: logp,
    entropy, lse, coef_logp, coef_entropy), row_stride apart (N rounded up, `aligned_length`): read by the sample
    kernel (`_node_regions`) and by `triton_logits`' dlogits kernels of the one node, which take the workspace as
    one pointer."""
    entropy_ptr = workspace_ptr + row_stride
    lse_ptr = entropy_ptr + row_stride
    coef_logp_ptr = lse_ptr + row_stride
    return workspace_ptr, entropy_ptr, lse_ptr, coef_logp_ptr, coef_logp_ptr + row_stride


@triton.jit
def _node_regions(workspace_ptr, row_stride, num_samples, NUM_PARTIALS_: tl.constexpr, NUM_METRICS: tl.constexpr,
                  REGION_ALIGN: tl.constexpr):
    """Pointers to the regions of the one-node loss's fp32 workspace (`NodeWorkspace`: one allocation, N rows and S
    samples, its regions in the order of its fields, each at a multiple of REGION_ALIGN elements), lse skipped: logp,
    entropy, coef_logp, coef_entropy [N], query_logp, response_logp [S], partials [S, NUM_PARTIALS], loss [1], metrics
    [NUM_METRICS], scales [3]. row_stride: N rounded up (`aligned_length`), which the launcher specializes as a
    multiple of 16 (it is never 1); the samples' strides are rounded up here. The compiler then knows every region's
    pointer as aligned as the workspace's, whatever N and S: at N not a multiple of 16 the coefficients' stores in
    pass 2 took the layout of an unaligned pointer, three layout conversions a step (sm_90 TTGIR:
    tests/kernels/test_logits_loss_node.py compiles the kernel as launched, at N = 47 and 48)."""
    sample_stride = _aligned_length(num_samples, REGION_ALIGN)
    logp_ptr, entropy_ptr, _, coef_logp_ptr, coef_entropy_ptr = node_row_regions(workspace_ptr, row_stride)
    query_logp_ptr = coef_entropy_ptr + row_stride
    response_logp_ptr = query_logp_ptr + sample_stride
    partials_ptr = response_logp_ptr + sample_stride
    loss_ptr = partials_ptr + _aligned_length(num_samples * NUM_PARTIALS_, REGION_ALIGN)
    metrics_ptr = loss_ptr + REGION_ALIGN
    scales_ptr = metrics_ptr + tl.cdiv(NUM_METRICS, REGION_ALIGN) * REGION_ALIGN  # constexprs: known
    return (logp_ptr, entropy_ptr, coef_logp_ptr, coef_entropy_ptr, query_logp_ptr, response_logp_ptr, partials_ptr,
            loss_ptr, metrics_ptr, scales_ptr)


@triton.jit
def _node_scalars(scalars_ptr):
    """The values of NODE_SCALARS, in its order, from the fp32 vector they are stored in (`node_scalars`)."""
    return (tl.load(scalars_ptr + 0), tl.load(scalars_ptr + 1), tl.load(scalars_ptr + 2), tl.load(scalars_ptr + 3),
            tl.load(scalars_ptr + 4), tl.load(scalars_ptr + 5), tl.load(scalars_ptr + 6), tl.load(scalars_ptr + 7),
            tl.load(scalars_ptr + 8), tl.load(scalars_ptr + 9), tl.load(scalars_ptr + 10), tl.load(scalars_ptr + 11),
            tl.load(scalars_ptr + 12), tl.load(scalars_ptr + 13), tl.load(scalars_ptr + 14),
            tl.load(scalars_ptr + 15), tl.load(scalars_ptr + 16), tl.load(scalars_ptr + 17),
            tl.load(scalars_ptr + 18), tl.load(scalars_ptr + 19), tl.load(scalars_ptr + 20))


@triton.jit
def _objective_sample_finish_kernel(
    workspace_ptr, row_stride, kind_ptr, spans_ptr, sample_ptr, advantages_ptr, ref_query_logp_ptr, query_weight_ptr,
    old_logp_ptr, ref_logp_ptr, token_weight_ptr, rollout_logp_ptr, entropy_threshold_ptr, scalars_ptr,
    num_items_ptr, num_seqs_ptr, counts_ptr, FLAGS: tl.constexpr, QKL_ESTIMATOR: tl.constexpr,
    PG_OBJECTIVE: tl.constexpr, NUM_ITEMS_MODE: tl.constexpr, NUM_SEQS_MODE: tl.constexpr, LOSS_AGG: tl.constexpr,
    NODE_NUM_PARTIALS: tl.constexpr = NUM_PARTIALS, NODE_ROW_BLOCK: tl.constexpr = ROW_BLOCK,
    NODE_SAMPLE_BLOCK: tl.constexpr = SAMPLE_BLOCK, NODE_NUM_METRICS: tl.constexpr = len(FLOAT_METRICS),
    REGION_ALIGN: tl.constexpr = REGION_ALIGN, VESPO_LOG_RATIO_CLAMP: tl.constexpr = VESPO_LOG_RATIO_CLAMP,
    VESPO_LOG_WEIGHT_MIN: tl.constexpr = VESPO_LOG_WEIGHT_MIN, TICKET: tl.constexpr = TICKET,
):
    """`_objective_sample_kernel` on each sample's span whose last program also runs kernel 2
    (`_finish_objective`): the one-node loss's objective in one launch (`launch_node_objective`). Its fp32 inputs and
    outputs (logp, entropy, the coefficients, the partials, the finish's results) are regions of one workspace
    (`_node_regions`), its float settings one vector (`_node_scalars`), its option flags the bits of FLAGS
    (NODE_FLAGS' order, `node_flags`): 23 parameters a launch passes, was 46 with a constexpr for each flag (and 76
    before the workspace and the vector), each one a launch binds on the host (`python -m bench.host_cost`). Its
    fixed sizes and constants, its helpers' too, are parameters after those with plain numbers as defaults (a launch
    passes none of them), not globals read in the kernel: a compiled kernel checks the value of each global it or a
    jit function it calls reads on every launch, about 0.5 us each (`triton_row_checks`' note)."""
    HAS_ENTROPY: tl.constexpr = (FLAGS >> 0) & 1 == 1
    HAS_QKL_REFERENCE: tl.constexpr = (FLAGS >> 1) & 1 == 1
    HAS_QUERY_WEIGHT: tl.constexpr = (FLAGS >> 2) & 1 == 1
    HAS_OLD: tl.constexpr = (FLAGS >> 3) & 1 == 1
    HAS_REF_LOGP: tl.constexpr = (FLAGS >> 4) & 1 == 1
    HAS_TOKEN_WEIGHT: tl.constexpr = (FLAGS >> 5) & 1 == 1
    HAS_ROLLOUT: tl.constexpr = (FLAGS >> 6) & 1 == 1
    HAS_IS_CAP: tl.constexpr = (FLAGS >> 7) & 1 == 1
    HAS_DUAL: tl.constexpr = (FLAGS >> 8) & 1 == 1
    HAS_PG_CLAMP: tl.constexpr = (FLAGS >> 9) & 1 == 1
    HAS_KL_CLAMP: tl.constexpr = (FLAGS >> 10) & 1 == 1
    USE_QKL: tl.constexpr = (FLAGS >> 11) & 1 == 1
    USE_POLICY_KL: tl.constexpr = (FLAGS >> 12) & 1 == 1
    ENTROPY_IN_TERM: tl.constexpr = (FLAGS >> 13) & 1 == 1
    SEQUENCE_RATIO: tl.constexpr = (FLAGS >> 14) & 1 == 1
    BIAS_CORRECTION: tl.constexpr = (FLAGS >> 15) & 1 == 1
    PER_TOKEN_MEAN: tl.constexpr = (FLAGS >> 16) & 1 == 1
    HAS_OFF_POLICY: tl.constexpr = (FLAGS >> 17) & 1 == 1
    HAS_ENTROPY_FILTER: tl.constexpr = (FLAGS >> 18) & 1 == 1
    ENTROPY_TOKEN_MEAN: tl.constexpr = (FLAGS >> 19) & 1 == 1
    logp_ptr, entropy_ptr, coef_logp_ptr, coef_entropy_ptr, query_logp_ptr, response_logp_ptr, partials_ptr, \
        loss_ptr, metrics_ptr, scales_ptr = _node_regions(workspace_ptr, row_stride, tl.num_programs(0),
                                                          NODE_NUM_PARTIALS, NODE_NUM_METRICS, REGION_ALIGN)
    clip_low, clip_high, dual_clip, pg_log_ratio_clamp, log_ratio_clamp, kl_clamp, log_rollout_is_cap, qkl_coef, \
        qkl_linear_beyond, policy_kl_coef, entropy_coef, cispo_clip_max, sapo_temperature_pos, sapo_temperature_neg, \
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, off_policy_mask_threshold, num_items, \
        num_seqs = _node_scalars(scalars_ptr)
    _sample_objective(
        logp_ptr, entropy_ptr, kind_ptr, None, spans_ptr, sample_ptr, None, advantages_ptr,
        ref_query_logp_ptr, query_weight_ptr, old_logp_ptr, ref_logp_ptr, token_weight_ptr, rollout_logp_ptr,
        entropy_threshold_ptr, partials_ptr, query_logp_ptr, response_logp_ptr, coef_logp_ptr, coef_entropy_ptr,
        clip_low, clip_high, dual_clip, pg_log_ratio_clamp, log_ratio_clamp, kl_clamp, log_rollout_is_cap, qkl_coef,
        qkl_linear_beyond, policy_kl_coef, entropy_coef, cispo_clip_max, sapo_temperature_pos, sapo_temperature_neg,
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, off_policy_mask_threshold, HAS_ENTROPY,
        HAS_QKL_REFERENCE, HAS_QUERY_WEIGHT, HAS_OLD, HAS_REF_LOGP, HAS_TOKEN_WEIGHT, HAS_ROLLOUT, HAS_IS_CAP,
        HAS_DUAL, HAS_PG_CLAMP, HAS_KL_CLAMP, USE_QKL, USE_POLICY_KL, ENTROPY_IN_TERM, SEQUENCE_RATIO,
        BIAS_CORRECTION, PER_TOKEN_MEAN, QKL_ESTIMATOR, PG_OBJECTIVE, HAS_OFF_POLICY, HAS_ENTROPY_FILTER,
        False, True, NODE_NUM_PARTIALS, NODE_ROW_BLOCK, num_items_ptr, num_seqs_ptr, loss_ptr, metrics_ptr,
        counts_ptr, scales_ptr, num_items, num_seqs, True, NUM_ITEMS_MODE, NUM_SEQS_MODE, LOSS_AGG,
        ENTROPY_TOKEN_MEAN, NODE_SAMPLE_BLOCK, VESPO_LOG_RATIO_CLAMP, VESPO_LOG_WEIGHT_MIN, TICKET)


@triton.jit
def _sample_objective(
    logp_ptr, entropy_ptr, kind_ptr, order_ptr, starts_ptr, sample_ptr, sample_ids_ptr, advantages_ptr,
    ref_query_logp_ptr, query_weight_ptr, old_logp_ptr, ref_logp_ptr, token_weight_ptr, rollout_logp_ptr,
    entropy_threshold_ptr, partials_ptr, query_logp_ptr, response_logp_ptr, coef_logp_ptr, coef_entropy_ptr, clip_low,
    clip_high, dual_clip, pg_log_ratio_clamp, log_ratio_clamp, kl_clamp, log_rollout_is_cap, qkl_coef,
    qkl_linear_beyond, policy_kl_coef, entropy_coef, cispo_clip_max, sapo_temperature_pos, sapo_temperature_neg,
    vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, off_policy_mask_threshold,
    HAS_ENTROPY: tl.constexpr, HAS_QKL_REFERENCE: tl.constexpr, HAS_QUERY_WEIGHT: tl.constexpr, HAS_OLD: tl.constexpr,
    HAS_REF_LOGP: tl.constexpr, HAS_TOKEN_WEIGHT: tl.constexpr, HAS_ROLLOUT: tl.constexpr, HAS_IS_CAP: tl.constexpr,
    HAS_DUAL: tl.constexpr, HAS_PG_CLAMP: tl.constexpr, HAS_KL_CLAMP: tl.constexpr, USE_QKL: tl.constexpr,
    USE_POLICY_KL: tl.constexpr, ENTROPY_IN_TERM: tl.constexpr, SEQUENCE_RATIO: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr, PER_TOKEN_MEAN: tl.constexpr, QKL_ESTIMATOR: tl.constexpr,
    PG_OBJECTIVE: tl.constexpr, HAS_OFF_POLICY: tl.constexpr, HAS_ENTROPY_FILTER: tl.constexpr,
    HAS_SAMPLE_IDS: tl.constexpr, SPANS: tl.constexpr, NUM_PARTIALS_: tl.constexpr, BLOCK: tl.constexpr,
    num_items_ptr, num_seqs_ptr, loss_ptr, metrics_ptr, counts_ptr, scales_ptr, num_items, num_seqs,
    FINISH: tl.constexpr, NUM_ITEMS_MODE: tl.constexpr, NUM_SEQS_MODE: tl.constexpr, LOSS_AGG: tl.constexpr,
    ENTROPY_TOKEN_MEAN: tl.constexpr, FINISH_BLOCK: tl.constexpr, VESPO_LOG_RATIO_CLAMP: tl.constexpr,
    VESPO_LOG_WEIGHT_MIN: tl.constexpr, TICKET: tl.constexpr,
):
    """Kernel 1's body (module docstring), and with FINISH, in the last program to store its partials,
    kernel 2's (`_finish_objective`, given the finish kernel's outputs and settings). VESPO_LOG_RATIO_CLAMP,
    VESPO_LOG_WEIGHT_MIN and TICKET: the module's constants, from the kernel's parameters."""
    K3_TOKEN: tl.constexpr = QKL_ESTIMATOR == 4
    VESPO: tl.constexpr = PG_OBJECTIVE == 3
    program = tl.program_id(0).to(tl.int64)
    sample = program
    if HAS_SAMPLE_IDS:  # a subset of the samples (a fused-linear chunk's): program p runs sample sample_ids[p]
        sample = tl.load(sample_ids_ptr + program).to(tl.int64)
    if SPANS:  # the program's rows: those of its sample in its span (starts_ptr: the spans)
        start, stop = span_bounds(starts_ptr, sample, tl.num_programs(0))
    else:  # the program's rows: order[start:stop], its sample's (starts by sample: a chunk's programs need no copy)
        start = tl.load(starts_ptr + sample)
        stop = tl.load(starts_ptr + sample + 1)
    entropy_threshold = 0.0
    if HAS_ENTROPY_FILTER:
        entropy_threshold = tl.load(entropy_threshold_ptr)
    # Pass 1: the sample's sums.
    query_sum = tl.zeros([BLOCK], dtype=tl.float32)
    response_sum = tl.zeros([BLOCK], dtype=tl.float32)
    query_rows = tl.zeros([BLOCK], dtype=tl.float32)
    response_rows = tl.zeros([BLOCK], dtype=tl.float32)
    log_ratio_sum = tl.zeros([BLOCK], dtype=tl.float32)
    weight_sum = tl.zeros([BLOCK], dtype=tl.float32)
    kl_sum = tl.zeros([BLOCK], dtype=tl.float32)
    query_kl_sum = tl.zeros([BLOCK], dtype=tl.float32)
    drift_sum = tl.zeros([BLOCK], dtype=tl.float32)
    vespo_log_weight_sum = tl.zeros([BLOCK], dtype=tl.float32)
    block_start = first_block_start(start, BLOCK) if SPANS else start
    while block_start < stop:  # triton_common's note on loop bounds
        positions = span_block_rows(block_start, BLOCK) if SPANS else block_start + tl.arange(0, BLOCK)
        rows, is_query, is_response, logp, entropy, log_ratio, weight, is_weight, gap, kl, kl_grad, drift, kept, \
            nonfinite = _row_values(
                positions, stop, sample, order_ptr, sample_ptr, kind_ptr, logp_ptr, entropy_ptr, old_logp_ptr,
                ref_logp_ptr,
                token_weight_ptr, rollout_logp_ptr, log_ratio_clamp, kl_clamp, log_rollout_is_cap, entropy_threshold,
                HAS_ENTROPY, HAS_OLD, HAS_REF_LOGP, HAS_TOKEN_WEIGHT, HAS_ROLLOUT, HAS_IS_CAP, HAS_KL_CLAMP,
                not VESPO, K3_TOKEN, HAS_ENTROPY_FILTER, SPANS)
        query_sum += tl.where(is_query, logp, 0.0)
        response_sum += tl.where(is_response, logp, 0.0)
        query_rows += is_query.to(tl.float32)
        response_rows += is_response.to(tl.float32)
        log_ratio_sum += log_ratio
        weight_sum += weight
        kl_sum += tl.where(is_response, kl, 0.0)
        query_kl_sum += tl.where(is_query, kl, 0.0)
        drift_sum += drift
        if VESPO:  # log w_s: the token log-ratios (after pg_log_ratio_clamp) and log rho_t, each clamped
            token_log_weight = log_ratio
            if HAS_PG_CLAMP:
                token_log_weight = clamp(token_log_weight, -pg_log_ratio_clamp, pg_log_ratio_clamp)
            vespo_log_weight_sum += clamp(token_log_weight, -VESPO_LOG_RATIO_CLAMP, VESPO_LOG_RATIO_CLAMP)
            if HAS_ROLLOUT and HAS_IS_CAP:
                log_is_weight = clamp(gap, None, log_rollout_is_cap)
                vespo_log_weight_sum += tl.where(is_response, clamp(log_is_weight, VESPO_LOG_WEIGHT_MIN,
                                                                  VESPO_LOG_RATIO_CLAMP), 0.0)
        block_start += BLOCK
    query_logp = tl.sum(query_sum, axis=0)
    num_query = tl.sum(query_rows, axis=0)
    num_response = tl.sum(response_rows, axis=0)
    tl.store(query_logp_ptr + sample, query_logp)
    tl.store(response_logp_ptr + sample, tl.sum(response_sum, axis=0))
    per_token = 1.0 / clamp(num_response, 1.0, None)
    token_factor = per_token if PER_TOKEN_MEAN else 1.0  # lam_s
    advantage = tl.load(advantages_ptr + sample).to(tl.float32)
    sample_weight = 1.0
    if HAS_QUERY_WEIGHT:
        sample_weight = tl.load(query_weight_ptr + sample).to(tl.float32)
    off_policy_masked = 0.0
    if HAS_OFF_POLICY:  # the sample's pg_t drops when A_s < 0 and its mean drift exceeds the threshold
        sample_kept = (advantage >= 0) | (tl.sum(drift_sum, axis=0) * per_token <= off_policy_mask_threshold)
        sample_weight = sample_weight * sample_kept.to(tl.float32)
        off_policy_masked = tl.where(sample_kept, 0.0, num_response)
    vespo_phi = 0.0
    if VESPO:  # phi(w_s) = exp(lam + k log w - lam w), (k, lam) by the sign of A_s; non-finite -> 0
        log_weight = clamp(tl.sum(vespo_log_weight_sum, axis=0), VESPO_LOG_WEIGHT_MIN, VESPO_LOG_RATIO_CLAMP)
        nonneg = advantage >= 0
        k = tl.where(nonneg, vespo_k_pos, vespo_k_neg)
        lam = tl.where(nonneg, vespo_lambda_pos, vespo_lambda_neg)
        vespo_phi = tl.exp(lam + k * log_weight - lam * tl.exp(log_weight))
        vespo_phi = tl.where(_is_finite(vespo_phi), vespo_phi, 0.0)

    # The sequence-level ratio, and the gradient every response row of the sample shares through it.
    sequence_log_ratio = tl.sum(log_ratio_sum, axis=0) * per_token
    sequence_pass = 1.0
    if HAS_PG_CLAMP:
        sequence_pass = _between(sequence_log_ratio, -pg_log_ratio_clamp, pg_log_ratio_clamp)
        sequence_log_ratio = clamp(sequence_log_ratio, -pg_log_ratio_clamp, pg_log_ratio_clamp)
    sequence_ratio = tl.exp(sequence_log_ratio)
    shared_grad = 0.0
    if SEQUENCE_RATIO:
        sequence_pg, sequence_slope, sequence_direct, sequence_clipped = _policy_surrogate(
            advantage, sequence_ratio, 0.0, clip_low, clip_high, dual_clip, cispo_clip_max, sapo_temperature_pos,
            sapo_temperature_neg, vespo_phi, PG_OBJECTIVE, HAS_DUAL)  # only its slope: the rest is per row below
        sequence_ratio_grad = sequence_ratio * sequence_pass * per_token  # d ratio_s / d logp_u, u a response row
        shared_grad = sample_weight * tl.sum(weight_sum, axis=0) * sequence_slope * sequence_ratio_grad
        if USE_POLICY_KL and BIAS_CORRECTION:
            shared_grad += policy_kl_coef * tl.sum(kl_sum, axis=0) * sequence_ratio_grad

    # The Query-KL of the sample, and its gradient on every query row.
    qkl_grad = 0.0
    qkl = 0.0
    if HAS_QKL_REFERENCE and K3_TOKEN:  # the mean of the query rows' k3_t; per row: qkl_coef / |Q_s| d k3_t / d logp_t
        qkl = tl.where(num_query > 0, tl.sum(query_kl_sum, axis=0) / clamp(num_query, 1.0, None), 0.0)
        if USE_QKL:
            qkl_grad = qkl_coef / clamp(num_query, 1.0, None)
    elif HAS_QKL_REFERENCE:
        r = tl.load(ref_query_logp_ptr + sample).to(tl.float32) - query_logp
        r_inside = clamp(r, -qkl_linear_beyond, qkl_linear_beyond)
        qkl_slope = _kl_slope(r_inside, QKL_ESTIMATOR)
        qkl = _kl_estimate(r_inside, QKL_ESTIMATOR) + qkl_slope * (r - r_inside)
        if HAS_KL_CLAMP:
            qkl_slope = qkl_slope * _between(qkl, -kl_clamp, kl_clamp)
            qkl = clamp(qkl, -kl_clamp, kl_clamp)
        qkl = tl.where(num_query > 0, qkl, 0.0)
        if USE_QKL:
            qkl_grad = -qkl_coef * qkl_slope

    # Pass 2: every row's term, its gradient coefficients, and the sample's partial sums.
    term_sum = tl.zeros([BLOCK], dtype=tl.float32)
    pg_sum = tl.zeros([BLOCK], dtype=tl.float32)
    policy_kl_sum = tl.zeros([BLOCK], dtype=tl.float32)
    entropy_sum = tl.zeros([BLOCK], dtype=tl.float32)
    clipped_rows = tl.zeros([BLOCK], dtype=tl.float32)
    ratio_sum = tl.zeros([BLOCK], dtype=tl.float32)
    is_weight_sum = tl.zeros([BLOCK], dtype=tl.float32)
    gap_abs_sum = tl.zeros([BLOCK], dtype=tl.float32)
    gap_max = tl.zeros([BLOCK], dtype=tl.float32)
    gap_nan = tl.zeros([BLOCK], dtype=tl.float32)
    nonfinite_rows = tl.zeros([BLOCK], dtype=tl.float32)
    kept_rows = tl.zeros([BLOCK], dtype=tl.float32)
    kept_entropy_sum = tl.zeros([BLOCK], dtype=tl.float32)
    block_start = first_block_start(start, BLOCK) if SPANS else start
    while block_start < stop:  # triton_common's note on loop bounds
        positions = span_block_rows(block_start, BLOCK) if SPANS else block_start + tl.arange(0, BLOCK)
        rows, is_query, is_response, logp, entropy, log_ratio, weight, is_weight, gap, kl, kl_grad, drift, kept, \
            nonfinite = _row_values(
                positions, stop, sample, order_ptr, sample_ptr, kind_ptr, logp_ptr, entropy_ptr, old_logp_ptr,
                ref_logp_ptr,
                token_weight_ptr, rollout_logp_ptr, log_ratio_clamp, kl_clamp, log_rollout_is_cap, entropy_threshold,
                HAS_ENTROPY, HAS_OLD, HAS_REF_LOGP, HAS_TOKEN_WEIGHT, HAS_ROLLOUT, HAS_IS_CAP, HAS_KL_CLAMP,
                not VESPO, K3_TOKEN, HAS_ENTROPY_FILTER, SPANS)
        kept_entropy = tl.where(kept, entropy, 0.0)  # the entropy bonus's rows
        query_coef = qkl_grad * kl_grad if K3_TOKEN else qkl_grad  # on query rows (kl_grad: their k3's slope)
        if SEQUENCE_RATIO:
            ratio = tl.where(is_response, sequence_ratio, 1.0)
            ratio_grad = tl.zeros_like(logp)  # the row's own share is in shared_grad
        else:
            ratio_pass = 1.0
            if HAS_PG_CLAMP:
                ratio_pass = _between(log_ratio, -pg_log_ratio_clamp, pg_log_ratio_clamp)
                log_ratio = clamp(log_ratio, -pg_log_ratio_clamp, pg_log_ratio_clamp)
            ratio = tl.exp(log_ratio)
            ratio_grad = ratio * ratio_pass  # d ratio_t / d logp_t
        pg, pg_slope, pg_direct, clipped = _policy_surrogate(
            advantage, ratio, logp, clip_low, clip_high, dual_clip, cispo_clip_max, sapo_temperature_pos,
            sapo_temperature_neg, vespo_phi, PG_OBJECTIVE, HAS_DUAL)
        row_weight = sample_weight * weight
        pg = row_weight * pg
        own_grad = row_weight * (pg_slope * ratio_grad + pg_direct)
        policy_kl = kl
        if BIAS_CORRECTION:
            policy_kl = ratio * kl
            kl_grad = ratio * kl_grad + kl * ratio_grad
        term = pg
        if USE_POLICY_KL:
            term += policy_kl_coef * policy_kl
            own_grad += policy_kl_coef * kl_grad
        if ENTROPY_IN_TERM:
            term -= entropy_coef * kept_entropy
        coef_logp = tl.where(is_response, token_factor * (own_grad + shared_grad), tl.where(is_query, query_coef, 0.0))
        if ENTROPY_IN_TERM:
            coef_entropy = tl.where(kept, -entropy_coef * token_factor, 0.0)
        else:
            coef_entropy = tl.where(kept, -entropy_coef, 0.0)
        # the scored rows of the block (of this sample): rows of kind 0 are left unwritten (the gradient kernel
        # gives them zeros), a span's rows of other samples to their own programs
        scored = is_query | is_response
        tl.store(coef_logp_ptr + rows, coef_logp, mask=scored)
        tl.store(coef_entropy_ptr + rows, coef_entropy, mask=scored)
        term_sum += tl.where(is_response, term, 0.0)
        pg_sum += tl.where(is_response, pg, 0.0)
        policy_kl_sum += tl.where(is_response, policy_kl, 0.0)
        entropy_sum += tl.where(is_response, entropy, 0.0)
        clipped_rows += (is_response & clipped).to(tl.float32)
        ratio_sum += tl.where(is_response, ratio, 0.0)
        is_weight_sum += is_weight
        gap_abs_sum += tl.abs(gap)
        gap_max = tl.maximum(gap_max, tl.abs(gap))  # drops NaN: counted apart (gap_nan)
        gap_nan += (gap != gap).to(tl.float32)
        nonfinite_rows += nonfinite.to(tl.float32)
        kept_rows += kept.to(tl.float32)
        kept_entropy_sum += kept_entropy
        block_start += BLOCK
    out = partials_ptr + sample * NUM_PARTIALS_
    tl.store(out + 0, num_query)
    tl.store(out + 1, num_response)
    tl.store(out + 2, qkl)
    tl.store(out + 3, tl.sum(term_sum, axis=0) * token_factor)
    tl.store(out + 4, tl.sum(pg_sum, axis=0) * token_factor)
    tl.store(out + 5, tl.sum(policy_kl_sum, axis=0))
    tl.store(out + 6, tl.sum(entropy_sum, axis=0))
    tl.store(out + 7, tl.sum(clipped_rows, axis=0))
    tl.store(out + 8, tl.sum(ratio_sum, axis=0))
    tl.store(out + 9, tl.sum(is_weight_sum, axis=0))
    tl.store(out + 10, tl.sum(gap_abs_sum, axis=0))
    # drops NaN: a NaN gap was counted apart (gap_nan) and makes the column NaN here
    tl.store(out + 11, tl.where(tl.sum(gap_nan, axis=0) > 0, float("nan"), tl.max(gap_max, axis=0)))
    tl.store(out + 12, tl.sum(nonfinite_rows, axis=0))
    tl.store(out + 13, off_policy_masked)
    tl.store(out + 14, tl.where(num_response > 0, vespo_phi, 0.0))
    tl.store(out + 15, tl.sum(kept_rows, axis=0))
    tl.store(out + 16, tl.sum(kept_entropy_sum, axis=0))
    if FINISH:
        # The last program of the grid reduces every sample's partials (CUDA's threadFenceReduction pattern): each
        # program takes a ticket from a counter that starts at 0 (counts' extra entry, zeroed before the launch) once
        # its stores are done; the barrier puts every thread's stores before the ticket, and the atomic's acq_rel
        # (at GPU scope) makes them visible to the program that takes the last ticket, whose loads come after it.
        tl.debug_barrier()
        ticket = tl.atomic_add(counts_ptr + TICKET, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) - 1:
            _finish_objective(partials_ptr, query_logp_ptr, num_items_ptr, num_seqs_ptr, loss_ptr, metrics_ptr,
                              counts_ptr, scales_ptr, tl.num_programs(0), num_items, num_seqs, qkl_coef,
                              entropy_coef, NUM_ITEMS_MODE, NUM_SEQS_MODE, LOSS_AGG, HAS_ENTROPY, HAS_QKL_REFERENCE,
                              HAS_REF_LOGP, HAS_ROLLOUT, HAS_IS_CAP, USE_QKL, ENTROPY_IN_TERM, ENTROPY_TOKEN_MEAN,
                              HAS_OFF_POLICY, VESPO, NUM_PARTIALS_, FINISH_BLOCK)


@triton.jit
def _column_sum(partials_ptr, num_samples, COLUMN: tl.constexpr, NUM_PARTIALS_: tl.constexpr, BLOCK: tl.constexpr,
                ONLY_NONZERO_COLUMN: tl.constexpr = -1, COUNT: tl.constexpr = False):
    """Sum over samples of one column of the partials, in a fixed order; with ONLY_NONZERO_COLUMN, only over the
    samples where that column is > 0; with COUNT, the number of such samples instead."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    block_start = 0
    while block_start < num_samples:  # triton_common's note on loop bounds
        samples = block_start + tl.arange(0, BLOCK)
        inside = samples < num_samples
        value = tl.load(partials_ptr + samples.to(tl.int64) * NUM_PARTIALS_ + COLUMN, mask=inside, other=0.0)
        if ONLY_NONZERO_COLUMN >= 0:
            keep = tl.load(partials_ptr + samples.to(tl.int64) * NUM_PARTIALS_ + ONLY_NONZERO_COLUMN, mask=inside,
                           other=0.0) > 0
            if COUNT:
                value = keep.to(tl.float32)
            else:
                value = tl.where(keep, value, 0.0)
        acc += value
        block_start += BLOCK
    return tl.sum(acc, axis=0)


@triton.jit
def _objective_finish_kernel(
    partials_ptr, query_logp_ptr, num_items_ptr, num_seqs_ptr, loss_ptr, metrics_ptr, counts_ptr, scales_ptr,
    num_samples, num_items: tl.float32, num_seqs: tl.float32, qkl_coef: tl.float32, entropy_coef: tl.float32,
    NUM_ITEMS_MODE: tl.constexpr, NUM_SEQS_MODE: tl.constexpr, LOSS_AGG: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    HAS_QKL_REFERENCE: tl.constexpr, HAS_REF_LOGP: tl.constexpr, HAS_ROLLOUT: tl.constexpr, HAS_IS_CAP: tl.constexpr,
    USE_QKL: tl.constexpr, ENTROPY_IN_TERM: tl.constexpr, ENTROPY_TOKEN_MEAN: tl.constexpr,
    HAS_OFF_POLICY: tl.constexpr, VESPO: tl.constexpr, NUM_PARTIALS_: tl.constexpr, BLOCK: tl.constexpr,
):
    _finish_objective(partials_ptr, query_logp_ptr, num_items_ptr, num_seqs_ptr, loss_ptr, metrics_ptr, counts_ptr,
                      scales_ptr, num_samples, num_items, num_seqs, qkl_coef, entropy_coef, NUM_ITEMS_MODE,
                      NUM_SEQS_MODE, LOSS_AGG, HAS_ENTROPY, HAS_QKL_REFERENCE, HAS_REF_LOGP, HAS_ROLLOUT, HAS_IS_CAP,
                      USE_QKL, ENTROPY_IN_TERM, ENTROPY_TOKEN_MEAN, HAS_OFF_POLICY, VESPO, NUM_PARTIALS_, BLOCK)


@triton.jit
def _finish_objective(
    partials_ptr, query_logp_ptr, num_items_ptr, num_seqs_ptr, loss_ptr, metrics_ptr, counts_ptr, scales_ptr,
    num_samples, num_items, num_seqs, qkl_coef, entropy_coef,
    NUM_ITEMS_MODE: tl.constexpr, NUM_SEQS_MODE: tl.constexpr, LOSS_AGG: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    HAS_QKL_REFERENCE: tl.constexpr, HAS_REF_LOGP: tl.constexpr, HAS_ROLLOUT: tl.constexpr, HAS_IS_CAP: tl.constexpr,
    USE_QKL: tl.constexpr, ENTROPY_IN_TERM: tl.constexpr, ENTROPY_TOKEN_MEAN: tl.constexpr,
    HAS_OFF_POLICY: tl.constexpr, VESPO: tl.constexpr, NUM_PARTIALS_: tl.constexpr, BLOCK: tl.constexpr,
):
    """Kernel 2's work (module docstring): the loss, the metrics, the counts and the global factors from the
    partials [S, P] of every sample, in a fixed order. Run by the finish kernel, or by the sample kernel's last
    program (its FINISH)."""
    response_rows = _column_sum(partials_ptr, num_samples, 1, NUM_PARTIALS_, BLOCK)
    samples_with_query = _column_sum(partials_ptr, num_samples, 0, NUM_PARTIALS_, BLOCK, 0, True)
    samples_with_response = _column_sum(partials_ptr, num_samples, 1, NUM_PARTIALS_, BLOCK, 1, True)
    # The denominators (modes: 0 = counted here, 1 = the number passed, 2 = a 1-element tensor), each >= 1.
    if NUM_SEQS_MODE == 0:
        seqs = samples_with_response
        query_seqs = samples_with_query
    elif NUM_SEQS_MODE == 1:
        seqs = num_seqs
        query_seqs = num_seqs
    else:
        seqs = tl.load(num_seqs_ptr).to(tl.float32)
        query_seqs = seqs
    if LOSS_AGG == 0:
        if NUM_ITEMS_MODE == 0:
            items = response_rows
        elif NUM_ITEMS_MODE == 1:
            items = num_items
        else:
            items = tl.load(num_items_ptr).to(tl.float32)
        term_scale = 1.0 / clamp(items, 1.0, None)
    else:
        term_scale = 1.0 / clamp(seqs, 1.0, None)
    qkl_scale = 1.0 / clamp(query_seqs, 1.0, None)
    per_response_row = 1.0 / clamp(response_rows, 1.0, None)
    entropy_mean = _column_sum(partials_ptr, num_samples, 6, NUM_PARTIALS_, BLOCK) * per_response_row
    kept_rows = _column_sum(partials_ptr, num_samples, 15, NUM_PARTIALS_, BLOCK)  # by the entropy filter
    per_kept_row = 1.0 / clamp(kept_rows, 1.0, None)
    kept_entropy_mean = _column_sum(partials_ptr, num_samples, 16, NUM_PARTIALS_, BLOCK) * per_kept_row
    qkl = _column_sum(partials_ptr, num_samples, 2, NUM_PARTIALS_, BLOCK, 0) * qkl_scale
    loss = _column_sum(partials_ptr, num_samples, 3, NUM_PARTIALS_, BLOCK, 1) * term_scale
    if ENTROPY_TOKEN_MEAN:
        loss -= entropy_coef * kept_entropy_mean
    if USE_QKL:
        loss += qkl_coef * qkl
    nonfinite = _column_sum(partials_ptr, num_samples, 12, NUM_PARTIALS_, BLOCK)
    tl.store(loss_ptr, tl.where(nonfinite > 0, float("nan"), loss))
    tl.store(scales_ptr + 0, term_scale)
    tl.store(scales_ptr + 1, qkl_scale)
    tl.store(scales_ptr + 2, term_scale if ENTROPY_IN_TERM else per_kept_row)

    # The metrics, in FLOAT_METRICS' order.
    nan = float("nan")
    query_acc = tl.zeros([BLOCK], dtype=tl.float32)
    gap_acc = tl.zeros([BLOCK], dtype=tl.float32)
    gap_nan = tl.zeros([BLOCK], dtype=tl.float32)
    block_start = 0
    while block_start < num_samples:  # triton_common's note on loop bounds
        samples = block_start + tl.arange(0, BLOCK)
        inside = samples < num_samples
        has_query = tl.load(partials_ptr + samples.to(tl.int64) * NUM_PARTIALS_ + 0, mask=inside, other=0.0) > 0
        query_acc += tl.where(has_query, tl.load(query_logp_ptr + samples, mask=inside, other=0.0), 0.0)
        sample_gap = tl.load(partials_ptr + samples.to(tl.int64) * NUM_PARTIALS_ + 11, mask=inside, other=0.0)
        gap_acc = tl.maximum(gap_acc, sample_gap)  # drops NaN: counted apart
        gap_nan += (sample_gap != sample_gap).to(tl.float32)
        block_start += BLOCK
    gap_max = tl.where(tl.sum(gap_nan, axis=0) > 0, nan, tl.max(gap_acc, axis=0))  # drops NaN: counted apart
    tl.store(metrics_ptr + 0, qkl if HAS_QKL_REFERENCE else nan)
    policy_kl = _column_sum(partials_ptr, num_samples, 5, NUM_PARTIALS_, BLOCK) * per_response_row
    tl.store(metrics_ptr + 1, policy_kl if HAS_REF_LOGP else nan)
    tl.store(metrics_ptr + 2, entropy_mean if HAS_ENTROPY else nan)
    tl.store(metrics_ptr + 3, _column_sum(partials_ptr, num_samples, 7, NUM_PARTIALS_, BLOCK) * per_response_row)
    tl.store(metrics_ptr + 4, _column_sum(partials_ptr, num_samples, 4, NUM_PARTIALS_, BLOCK, 1) * term_scale)
    tl.store(metrics_ptr + 5, _column_sum(partials_ptr, num_samples, 8, NUM_PARTIALS_, BLOCK) * per_response_row)
    tl.store(metrics_ptr + 6, tl.sum(query_acc, axis=0) / clamp(samples_with_query, 1.0, None))
    is_weight = _column_sum(partials_ptr, num_samples, 9, NUM_PARTIALS_, BLOCK) * per_response_row
    tl.store(metrics_ptr + 7, is_weight if HAS_ROLLOUT and HAS_IS_CAP else nan)
    gap_abs = _column_sum(partials_ptr, num_samples, 10, NUM_PARTIALS_, BLOCK) * per_response_row
    tl.store(metrics_ptr + 8, gap_abs if HAS_ROLLOUT else nan)
    tl.store(metrics_ptr + 9, gap_max if HAS_ROLLOUT else nan)
    masked = _column_sum(partials_ptr, num_samples, 13, NUM_PARTIALS_, BLOCK) * per_response_row
    tl.store(metrics_ptr + 10, masked if HAS_OFF_POLICY else nan)
    tl.store(metrics_ptr + 11, kept_entropy_mean if HAS_ENTROPY else nan)
    phi_mean = _column_sum(partials_ptr, num_samples, 14, NUM_PARTIALS_, BLOCK) / clamp(samples_with_response, 1.0,
                                                                                           None)
    tl.store(metrics_ptr + 12, phi_mean if VESPO else nan)
    tl.store(counts_ptr + 0, response_rows.to(tl.int64))
    tl.store(counts_ptr + 1, nonfinite.to(tl.int64))
    tl.store(counts_ptr + 2, kept_rows.to(tl.int64))


@triton.jit
def objective_row_gradients(kind, coef_logp, coef_entropy, scales_ptr, grad_loss_ptr):
    """(d loss / d logp_t, d loss / d H_t) of rows of token kind `kind` from their gradient coefficients (module
    docstring, kernel 3), for grad_loss [] (None: 1, the fused path's d loss / d loss) and the global factors [3]
    in memory; also what `triton_logits`' backward kernels form themselves when the loss is one autograd node
    (`triton_logits_loss`)."""
    grad_loss = 1.0
    if grad_loss_ptr is not None:
        grad_loss = tl.load(grad_loss_ptr).to(tl.float32)
    term_scale = tl.load(scales_ptr + 0)
    qkl_scale = tl.load(scales_ptr + 1)
    entropy_scale = tl.load(scales_ptr + 2)
    # rows of kind 0 (and rows no sample program visited: their coefficients are never written) get exact zeros
    grad_logp = tl.where(kind == 2, coef_logp * (term_scale * grad_loss),
                         tl.where(kind == 1, coef_logp * (qkl_scale * grad_loss), 0.0))
    grad_entropy = tl.where(kind == 2, coef_entropy * (entropy_scale * grad_loss), 0.0)
    return grad_logp, grad_entropy


@triton.jit
def _objective_grad_kernel(grad_loss_ptr, kind_ptr, coef_logp_ptr, coef_entropy_ptr, scales_ptr, grad_logp_ptr,
                           grad_entropy_ptr, num_rows, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = rows < num_rows
    grad_logp, grad_entropy = objective_row_gradients(
        tl.load(kind_ptr + rows, mask=inside, other=0), tl.load(coef_logp_ptr + rows, mask=inside, other=0.0),
        tl.load(coef_entropy_ptr + rows, mask=inside, other=0.0), scales_ptr, grad_loss_ptr)
    tl.store(grad_logp_ptr + rows, grad_logp, mask=inside)
    tl.store(grad_entropy_ptr + rows, grad_entropy, mask=inside)


SETTING_NAMES = ("has_entropy", "has_qkl_reference", "has_query_weight", "has_old", "has_ref_logp", "has_token_weight",
                 "has_rollout", "has_is_cap", "has_dual", "has_pg_clamp", "has_kl_clamp", "sequence_ratio",
                 "bias_correction", "qkl_estimator", "loss_agg", "entropy_in_loss_agg", "clip_low", "clip_high",
                 "dual_clip", "pg_log_ratio_clamp", "log_ratio_clamp", "kl_clamp", "log_rollout_is_cap", "qkl_coef",
                 "qkl_linear_beyond", "policy_kl_coef", "entropy_coef", "num_items_mode", "num_items",
                 "num_seqs_mode", "num_seqs", "pg_objective", "has_off_policy", "cispo_clip_max",
                 "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                 "vespo_lambda_neg", "off_policy_mask_threshold", "has_entropy_filter")


class _Given(NamedTuple):
    """Which optional `LossInputs` tensors a call gives: all `objective_settings` reads of them."""

    ref_query_logp: bool
    query_weight: bool
    old_logp: bool
    ref_logp: bool
    token_weight: bool
    rollout_logp: bool


def given_inputs(inputs: LossInputs) -> _Given:
    """Which optional `LossInputs` tensors `inputs` holds."""
    return _Given(inputs.ref_query_logp is not None, inputs.query_weight is not None, inputs.old_logp is not None,
                  inputs.ref_logp is not None, inputs.token_weight is not None, inputs.rollout_logp is not None)


def objective_settings(options: LossOptions, inputs: LossInputs, has_entropy: bool) -> List[float]:
    """The options the kernels read, as the list of floats the op takes, in SETTING_NAMES' order (flags as 0 / 1,
    the estimator, loss_agg and pg_objective as their codes; an absent number as 0). has_qkl_reference: the
    reference the Query-KL's estimator reads is given (ref_query_logp, or ref_logp for "k3-token"). Built once per
    distinct (options, given tensors) when no option holds a tensor (a ~20 us dict a call otherwise); the list
    returned is shared: read it, never change it."""
    given = given_inputs(inputs)
    if _holds_tensor(options):
        return _settings(options, given, has_entropy)  # a tensor's == reads it: never a cache key
    return _cached_settings(options, given, has_entropy)


def _holds_tensor(options: LossOptions) -> bool:
    return isinstance(options.num_items, torch.Tensor) or isinstance(options.num_seqs, torch.Tensor)


def _settings(options: LossOptions, given: _Given, has_entropy: bool) -> List[float]:
    cap = options.rollout_is_cap
    has_qkl_reference = given.ref_logp if options.qkl_estimator == "k3-token" else given.ref_query_logp
    threshold = options.off_policy_mask_threshold
    settings = dict(
        has_entropy=has_entropy, has_qkl_reference=has_qkl_reference,
        has_query_weight=given.query_weight, has_old=given.old_logp,
        has_ref_logp=given.ref_logp, has_token_weight=given.token_weight,
        has_rollout=given.rollout_logp, has_is_cap=cap is not None,
        has_dual=options.dual_clip is not None, has_pg_clamp=options.pg_log_ratio_clamp is not None,
        has_kl_clamp=options.kl_clamp is not None, sequence_ratio=options.ratio_level == "sequence",
        bias_correction=options.policy_kl_bias_correction, qkl_estimator=QKL_ESTIMATOR_CODES[options.qkl_estimator],
        loss_agg=LOSS_AGG_CODES[options.loss_agg], entropy_in_loss_agg=options.entropy_agg == "loss-agg",
        clip_low=options.clip_low, clip_high=options.clip_high, dual_clip=options.dual_clip or 0.0,
        pg_log_ratio_clamp=options.pg_log_ratio_clamp or 0.0, log_ratio_clamp=options.log_ratio_clamp,
        kl_clamp=options.kl_clamp or 0.0, log_rollout_is_cap=0.0 if cap is None else math.log(cap),
        qkl_coef=options.qkl_coef, qkl_linear_beyond=options.qkl_linear_beyond,
        policy_kl_coef=options.policy_kl_coef, entropy_coef=options.entropy_coef,
        num_items_mode=_denominator_mode(options.num_items), num_items=_denominator_value(options.num_items),
        num_seqs_mode=_denominator_mode(options.num_seqs), num_seqs=_denominator_value(options.num_seqs),
        pg_objective=PG_OBJECTIVE_CODES[options.pg_objective], has_off_policy=threshold is not None,
        cispo_clip_max=options.cispo_clip_max, sapo_temperature_pos=options.sapo_temperature_pos,
        sapo_temperature_neg=options.sapo_temperature_neg, vespo_k_pos=options.vespo_k_pos,
        vespo_lambda_pos=options.vespo_lambda_pos, vespo_k_neg=options.vespo_k_neg,
        vespo_lambda_neg=options.vespo_lambda_neg, off_policy_mask_threshold=threshold or 0.0,
        has_entropy_filter=options.top_entropy_quantile < 1.0)
    return [float(settings[name]) for name in SETTING_NAMES]


_cached_settings = functools.lru_cache(maxsize=64)(_settings)


def _denominator_mode(value) -> float:
    """0: counted by the kernels (None), 1: a number, 2: a 1-element tensor (passed as a tensor argument)."""
    return 0.0 if value is None else 2.0 if isinstance(value, torch.Tensor) else 1.0


def _denominator_value(value) -> float:
    return float(value) if value is not None and not isinstance(value, torch.Tensor) else 0.0


class SampleOutputs(NamedTuple):
    """What the sample kernel writes: partials [S, NUM_PARTIALS], query_logp [S], response_logp [S] (by sample) and
    the gradient coefficients coef_logp, coef_entropy [N] (by row), all fp32."""

    partials: torch.Tensor
    query_logp: torch.Tensor
    response_logp: torch.Tensor
    coef_logp: torch.Tensor
    coef_entropy: torch.Tensor

    @classmethod
    def empty(cls, num_rows: int, num_samples: int, device) -> SampleOutputs:
        fp32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(num_samples, NUM_PARTIALS, **fp32), torch.empty(num_samples, **fp32),
                   torch.empty(num_samples, **fp32), torch.empty(num_rows, **fp32), torch.empty(num_rows, **fp32))


class FinishOutputs(NamedTuple):
    """What the finish kernel writes: loss [] fp32, metrics [len(FLOAT_METRICS)] fp32, counts [len(COUNT_METRICS)]
    int64 and the global factors [3] fp32."""

    loss: torch.Tensor
    metrics: torch.Tensor
    counts: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def empty(cls, device) -> FinishOutputs:
        fp32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty((), **fp32), torch.empty(len(FLOAT_METRICS), **fp32),
                   torch.empty(len(COUNT_METRICS), dtype=torch.int64, device=device), torch.empty(3, **fp32))


def aligned_length(count: int) -> int:
    """count rounded up to a multiple of REGION_ALIGN: the elements a `NodeWorkspace` region of that length takes."""
    return -(-count // REGION_ALIGN) * REGION_ALIGN


# the pieces of a NodeWorkspace after its partials: loss [1], metrics, scales [3], each but the last padded
_FINISH_PIECES = (1, REGION_ALIGN - 1, len(FLOAT_METRICS), -len(FLOAT_METRICS) % REGION_ALIGN, 3)


def _region_pieces(rows_padded: bool, samples_padded: bool):
    """The NodeWorkspace regions among the pieces `NodeWorkspace.empty` splits it into (a getter of them), where the
    row regions are followed by padding or not, and the sample regions."""
    pieces_per_region = [1 + rows_padded] * 5 + [1 + samples_padded] * 3 + [2, 2, 1]
    return operator.itemgetter(*itertools.accumulate(pieces_per_region[:-1], initial=0))


_REGION_PIECES = {(rows, samples): _region_pieces(rows, samples) for rows in (False, True) for samples in (False, True)}


class NodeWorkspace(NamedTuple):
    """The one-node loss's fp32 tensors (`triton_logits_loss`) as views of one allocation, `whole`, in the order of
    the fields: logp, entropy, lse [N] (the logits kernels' outputs), coef_logp, coef_entropy [N], query_logp,
    response_logp [S], partials [S * NUM_PARTIALS], loss [], metrics [len(FLOAT_METRICS)], scales [3], each at a
    multiple of REGION_ALIGN elements (a region's length rounded up to it, `aligned_length`, is where the next one
    begins); the sample kernel finds them from `whole` (`_node_regions`)."""

    whole: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    coef_logp: torch.Tensor
    coef_entropy: torch.Tensor
    query_logp: torch.Tensor
    response_logp: torch.Tensor
    partials: torch.Tensor
    loss: torch.Tensor
    metrics: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def empty(cls, num_rows: int, num_samples: int, device) -> NodeWorkspace:
        # the pieces of the allocation: each region, then its padding up to REGION_ALIGN where it has any (the row
        # regions' where N is not a multiple of it, the sample regions' where S is not: S * NUM_PARTIALS neither)
        row_padding, sample_padding = -num_rows % REGION_ALIGN, -num_samples % REGION_ALIGN
        rows = (num_rows, row_padding) if row_padding else (num_rows,)
        samples = (num_samples, sample_padding) if sample_padding else (num_samples,)
        partials = num_samples * NUM_PARTIALS
        pieces = rows * 5 + samples * 2 + ((partials, -partials % REGION_ALIGN) if sample_padding
                                           else (partials,)) + _FINISH_PIECES
        whole = torch.empty(sum(pieces), dtype=torch.float32, device=device)
        *views, loss, metrics, scales = _REGION_PIECES[bool(row_padding), bool(sample_padding)](
            whole.split_with_sizes(pieces))
        return cls(whole, *views, loss.view(()), metrics, scales)

    def sample_outputs(self) -> SampleOutputs:
        """The regions the sample kernel writes, as `launch_sample_kernel` takes them."""
        return SampleOutputs(self.partials.view(-1, NUM_PARTIALS), self.query_logp, self.response_logp,
                             self.coef_logp, self.coef_entropy)


class KernelArguments(NamedTuple):
    """What the sample and finish kernels take from one `objective_settings` (the scalars in their parameters'
    order, the constexprs by name), built once per distinct settings (`kernel_arguments`): a launch passes them as
    they are."""

    sample_scalars: Tuple[float, ...]
    sample_constexprs: Dict[str, object]
    finish_scalars: Tuple[float, ...]
    finish_constexprs: Dict[str, object]
    sample_finish_constexprs: Dict[str, object]  # `_objective_sample_finish_kernel`'s, all of them
    node_scalars: Tuple[float, ...]  # its NODE_SCALARS, stored on the device by `node_scalars`


class ObjectivePlan(NamedTuple):
    """What a call's options and given inputs fix for the objective (`objective_plan`): the settings, their
    `KernelArguments`, and for each LossMetrics field its index in the metrics and counts vectors (FLOAT_METRICS,
    then COUNT_METRICS), None where the metric does not apply (`objective.applicable_metrics`); and the options'
    `LogitTransform`, which the one-node loss hands its logits kernels (`triton_logits_loss`)."""

    settings: List[float]
    arguments: KernelArguments
    metric_slots: Tuple[Optional[int], ...]
    logit_transform: LogitTransform


_PLANS: Dict[tuple, ObjectivePlan] = {}
_MAX_PLANS = 64  # distinct (options, given inputs) kept; a trainer has one or two


def objective_plan(options: LossOptions, inputs: LossInputs, has_entropy: bool) -> ObjectivePlan:
    """The `ObjectivePlan` of a call, built once per distinct (options, given tensors, has_entropy) when no option
    holds a tensor (then every call); shared: read it, never change it. For the one-node loss, which never traces
    (`triton_logits_loss`): a dict lookup instead of the settings' and the arguments' caches, the metrics' names."""
    given = given_inputs(inputs)
    if _holds_tensor(options):
        return _objective_plan(options, inputs, given, has_entropy)
    key = (options, given, has_entropy)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _objective_plan(options, inputs, given, has_entropy)
    return plan


def _objective_plan(options: LossOptions, inputs: LossInputs, given: _Given, has_entropy: bool) -> ObjectivePlan:
    settings = _settings(options, given, has_entropy)
    return ObjectivePlan(settings, kernel_arguments(settings),
                         metric_slots(objective.applicable_metrics(inputs, options, has_entropy=has_entropy)),
                         options.logit_transform)


_METRIC_INDEX = {name: index for index, name in enumerate(FLOAT_METRICS + COUNT_METRICS)}


def metric_slots(applicable) -> Tuple[Optional[int], ...]:
    """For each LossMetrics field, its index in FLOAT_METRICS + COUNT_METRICS when in `applicable`, else None."""
    return tuple(_METRIC_INDEX[name] if name in applicable else None for name in objective.METRIC_NAMES)


def kernel_arguments(settings: List[float]) -> KernelArguments:
    """`KernelArguments` of `settings` (`objective_settings`), from a cache keyed by their values: shared, never
    changed (a launch copies the constexprs into its own keywords)."""
    return _cached_kernel_arguments(tuple(settings))


@functools.lru_cache(maxsize=64)
def _cached_kernel_arguments(settings: Tuple[float, ...]) -> KernelArguments:
    s = dict(zip(SETTING_NAMES, settings))

    def flag(name):
        return bool(s[name])

    use_qkl = flag("has_qkl_reference") and s["qkl_coef"] != 0
    entropy_in_term = flag("entropy_in_loss_agg") and s["entropy_coef"] != 0
    sample_scalars = tuple(s[name] for name in (
        "clip_low", "clip_high", "dual_clip", "pg_log_ratio_clamp", "log_ratio_clamp", "kl_clamp", "log_rollout_is_cap",
        "qkl_coef", "qkl_linear_beyond", "policy_kl_coef", "entropy_coef", "cispo_clip_max", "sapo_temperature_pos",
        "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
        "off_policy_mask_threshold"))
    sample_constexprs = dict(
        HAS_ENTROPY=flag("has_entropy"), HAS_QKL_REFERENCE=flag("has_qkl_reference"),
        HAS_QUERY_WEIGHT=flag("has_query_weight"), HAS_OLD=flag("has_old"), HAS_REF_LOGP=flag("has_ref_logp"),
        HAS_TOKEN_WEIGHT=flag("has_token_weight"), HAS_ROLLOUT=flag("has_rollout"),
        HAS_IS_CAP=flag("has_is_cap"), HAS_DUAL=flag("has_dual"), HAS_PG_CLAMP=flag("has_pg_clamp"),
        HAS_KL_CLAMP=flag("has_kl_clamp"), USE_QKL=use_qkl,
        USE_POLICY_KL=flag("has_ref_logp") and s["policy_kl_coef"] != 0, ENTROPY_IN_TERM=entropy_in_term,
        SEQUENCE_RATIO=flag("sequence_ratio"), BIAS_CORRECTION=flag("bias_correction"),
        PER_TOKEN_MEAN=s["loss_agg"] == LOSS_AGG_CODES["seq-mean-token-mean"],
        QKL_ESTIMATOR=int(s["qkl_estimator"]), PG_OBJECTIVE=int(s["pg_objective"]),
        HAS_OFF_POLICY=flag("has_off_policy"), HAS_ENTROPY_FILTER=flag("has_entropy_filter"),
        NUM_PARTIALS_=NUM_PARTIALS, BLOCK=ROW_BLOCK)
    finish_scalars = (s["num_items"], s["num_seqs"], s["qkl_coef"], s["entropy_coef"])
    finish_constexprs = dict(
        NUM_ITEMS_MODE=int(s["num_items_mode"]), NUM_SEQS_MODE=int(s["num_seqs_mode"]),
        LOSS_AGG=int(s["loss_agg"]), HAS_ENTROPY=flag("has_entropy"), HAS_QKL_REFERENCE=flag("has_qkl_reference"),
        HAS_REF_LOGP=flag("has_ref_logp"), HAS_ROLLOUT=flag("has_rollout"), HAS_IS_CAP=flag("has_is_cap"),
        USE_QKL=use_qkl, ENTROPY_IN_TERM=entropy_in_term,
        ENTROPY_TOKEN_MEAN=not flag("entropy_in_loss_agg") and s["entropy_coef"] != 0,
        HAS_OFF_POLICY=flag("has_off_policy"), VESPO=s["pg_objective"] == PG_OBJECTIVE_CODES["vespo"],
        NUM_PARTIALS_=NUM_PARTIALS, BLOCK=SAMPLE_BLOCK)
    sample_finish_constexprs = dict(
        FLAGS=node_flags(dict(sample_constexprs, ENTROPY_TOKEN_MEAN=finish_constexprs["ENTROPY_TOKEN_MEAN"])),
        **{name: sample_constexprs[name] for name in ("QKL_ESTIMATOR", "PG_OBJECTIVE")},
        **{name: finish_constexprs[name] for name in ("NUM_ITEMS_MODE", "NUM_SEQS_MODE", "LOSS_AGG")})
    return KernelArguments(sample_scalars, sample_constexprs, finish_scalars, finish_constexprs,
                           sample_finish_constexprs, tuple(s[name] for name in NODE_SCALARS))


# (NODE_SCALARS' values, device) -> (the fp32 vector on the device, its host copy)
_NODE_SCALARS: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}


def node_scalars(arguments: KernelArguments, device: torch.device) -> torch.Tensor:
    """`arguments.node_scalars` as an fp32 vector on `device`, made once per distinct values and device and then
    shared (read-only): a launch passes one pointer, not 21 floats. Made on CUDA by a copy from pinned memory, which
    does not block the host; the pinned source is kept with it (a CUDA graph that captured the copy reads it again)."""
    key = (arguments.node_scalars, device)
    cached = _NODE_SCALARS.get(key)
    if cached is None:
        if len(_NODE_SCALARS) >= _MAX_PLANS:
            _NODE_SCALARS.clear()
        on_cuda = device.type == "cuda"
        host = torch.tensor(arguments.node_scalars, dtype=torch.float32, pin_memory=on_cuda)
        cached = _NODE_SCALARS[key] = (host.to(device, non_blocking=on_cuda), host)
    return cached[0]


def launch_sample_kernel(out: SampleOutputs, token_logp, entropy, token_kind, order, starts, sample_ids,
                         loss_tensors, entropy_threshold, settings: List[float], sample_index=None) -> None:
    """Kernel 1 (module docstring), one program per entry of starts[:-1], or per entry of sample_ids when given:
    program p walks the rows order[starts[s]:starts[s + 1]] of its sample s (p, or sample_ids[p]) and writes `out`
    (its rows' coefficients, its sample's partials). With sample_index [N] (order and sample_ids None),
    starts is `triton_segment.sample_spans`' [2, S] instead and program p walks the span of sample p.
    token_logp, entropy [N] fp32; loss_tensors: the `LossInputs` tensors in their order, fp32 or None;
    entropy_threshold [] fp32 or None; settings: `objective_settings`."""
    spans = sample_index is not None
    num_programs = starts.shape[1] if spans else starts.shape[0] - 1 if sample_ids is None else sample_ids.shape[0]
    if num_programs <= 0:
        return
    arguments = kernel_arguments(settings)
    # an absent tensor goes as None (a constexpr None to Triton: its flag is off, the kernel never reads it; a
    # launch binds and checks no pointer for it)
    _objective_sample_kernel[(num_programs,)](
        token_logp, entropy, token_kind, order, starts, sample_index, sample_ids, *loss_tensors, entropy_threshold,
        *out, *arguments.sample_scalars, **arguments.sample_constexprs, HAS_SAMPLE_IDS=sample_ids is not None,
        SPANS=spans)


def launch_node_objective(workspace: NodeWorkspace, token_kind, sample_index, spans, loss_tensors, num_items,
                          num_seqs, entropy_threshold, settings: List[float], arguments: KernelArguments,
                          counts: Optional[torch.Tensor] = None):
    """Kernels 1 and 2 (module docstring) for the one-node loss (`triton_logits_loss`), on logp and entropy in
    `workspace` (`NodeWorkspace`), writing its other regions: one launch of `_objective_sample_finish_kernel` (its
    last program runs kernel 2) when there are samples, else kernel 2 alone. token_kind, sample_index [N]
    contiguous; spans [2, S] (`triton_segment.sample_spans`); loss_tensors, entropy_threshold as
    `launch_sample_kernel`'s; num_items, num_seqs as `launch_finish_kernel`'s; arguments: `kernel_arguments(settings)`
    (`ObjectivePlan`); counts: [len(COUNT_METRICS) + 1] int64 whose last entry, the programs' ticket counter, is
    zeroed by a kernel queued before (`triton_row_checks.RowChecksWithSpans.counts`), else None (zeroed here, a fill
    launch). Returns the counts, the ticket left at S."""
    if counts is None:
        counts = torch.zeros(NODE_COUNTS, dtype=torch.int64, device=workspace.whole.device)
    num_samples = spans.shape[1]
    if num_samples == 0:
        launch_finish_kernel(workspace.sample_outputs(), num_items, num_seqs, settings, results=FinishOutputs(
            workspace.loss, workspace.metrics, counts, workspace.scales))
        return counts
    _objective_sample_finish_kernel[(num_samples,)](
        workspace.whole, aligned_length(token_kind.shape[0]), token_kind, spans, sample_index, *loss_tensors,
        entropy_threshold, node_scalars(arguments, workspace.whole.device), num_items, num_seqs, counts,
        **arguments.sample_finish_constexprs)
    return counts


def launch_finish_kernel(out: SampleOutputs, num_items, num_seqs, settings: List[float], *,
                         results: Optional[FinishOutputs] = None):
    """Kernel 2: (loss [] fp32, metrics [len(FLOAT_METRICS)] fp32, counts [len(COUNT_METRICS)] int64, the global
    factors [3] fp32) from the partials of every sample, written into `results` when given (else allocated);
    num_items / num_seqs: 1-element fp32 tensors or None; settings: `objective_settings`."""
    arguments = kernel_arguments(settings)
    loss, metrics, counts, scales = results or FinishOutputs.empty(out.partials.device)
    _objective_finish_kernel[(1,)](  # num_items / num_seqs None: as the sample kernel's absent tensors
        out.partials, out.query_logp, num_items, num_seqs, loss, metrics, counts, scales, out.partials.shape[0],
        *arguments.finish_scalars, **arguments.finish_constexprs)
    return loss, metrics, counts, scales


def launch_grad_kernel(grad_loss, token_kind, coef_logp, coef_entropy, scales, out=None):
    """Kernel 3: (d loss / d token_logp, d loss / d entropy), each [n] fp32, of the n rows whose token_kind and
    coefficients are given ([n] each), for grad_loss [] (None: 1) and the global factors [3]; written into `out`
    when given (two contiguous [n] fp32 tensors, returned), else allocated."""
    num_rows = coef_logp.shape[0]
    grad_logp, grad_entropy = out if out is not None else (torch.empty_like(coef_logp),
                                                           torch.empty_like(coef_entropy))
    if num_rows > 0:
        _objective_grad_kernel[(-(-num_rows // ROW_BLOCK),)](  # cdiv (triton.cdiv is a jit call: ~10 us)
            grad_loss, token_kind, coef_logp, coef_entropy, scales, grad_logp, grad_entropy, num_rows, BLOCK=ROW_BLOCK)
    return grad_logp, grad_entropy


# loss, query_logp, response_logp, metrics, counts, the two gradient coefficients, the global factors
ObjectiveOutputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                         torch.Tensor, torch.Tensor]


def objective_forward(token_logp: torch.Tensor, entropy: Optional[torch.Tensor], token_kind: torch.Tensor,
                 sample_index: torch.Tensor, spans: torch.Tensor, advantages: torch.Tensor,
                 ref_query_logp: Optional[torch.Tensor], query_weight: Optional[torch.Tensor],
                 old_logp: Optional[torch.Tensor], ref_logp: Optional[torch.Tensor],
                 token_weight: Optional[torch.Tensor], rollout_logp: Optional[torch.Tensor],
                 num_items: Optional[torch.Tensor], num_seqs: Optional[torch.Tensor],
                 entropy_threshold: Optional[torch.Tensor], settings: List[float]) -> ObjectiveOutputs:
    """The objective's forward (module docstring): token_logp, entropy [N] fp32, token_kind, sample_index [N]
    (contiguous), spans [2, S] (`triton_segment.sample_spans` of the scored rows), the `LossInputs` tensors,
    num_items / num_seqs as 1-element tensors when given so, entropy_threshold [] fp32 with the entropy filter (the
    response rows' entropy quantile, `triton_quantile`), `settings` from `objective_settings`. Returns loss [] fp32,
    query_logp [S], response_logp [S], metrics [len(FLOAT_METRICS)] fp32, counts [len(COUNT_METRICS)] int64, and
    for the backward the gradient coefficients [N] x 2 and the global factors [3]. Only `loss` is differentiable
    (in token_logp, entropy)."""
    out = SampleOutputs.empty(token_logp.shape[0], advantages.shape[0], token_logp.device)
    loss_tensors = (advantages, ref_query_logp, query_weight, old_logp, ref_logp, token_weight, rollout_logp)
    launch_sample_kernel(out, token_logp, entropy, token_kind, None, spans, None, loss_tensors, entropy_threshold,
                         settings, sample_index)
    loss, metrics, counts, scales = launch_finish_kernel(out, num_items, num_seqs, settings)
    return loss, out.query_logp, out.response_logp, metrics, counts, out.coef_logp, out.coef_entropy, scales


objective_op = torch.library.custom_op("erpo::triton_objective", objective_forward, mutates_args=())


@objective_op.register_fake
def _(token_logp, entropy, token_kind, sample_index, spans, advantages, ref_query_logp, query_weight, old_logp,
      ref_logp, token_weight, rollout_logp, num_items, num_seqs, entropy_threshold, settings):
    num_rows, num_samples = token_logp.shape[0], advantages.shape[0]
    fp32 = dict(dtype=torch.float32)
    return (token_logp.new_empty((), **fp32), token_logp.new_empty(num_samples, **fp32),
            token_logp.new_empty(num_samples, **fp32), token_logp.new_empty(len(FLOAT_METRICS), **fp32),
            token_logp.new_empty(len(COUNT_METRICS), dtype=torch.int64), token_logp.new_empty(num_rows, **fp32),
            token_logp.new_empty(num_rows, **fp32), token_logp.new_empty(3, **fp32))


def objective_backward(grad_loss: torch.Tensor, token_kind: torch.Tensor, coef_logp: torch.Tensor,
                          coef_entropy: torch.Tensor, scales: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d loss / d token_logp, d loss / d entropy), each [N] fp32, for grad_loss [] (module docstring, kernel 3)."""
    return launch_grad_kernel(grad_loss, token_kind, coef_logp, coef_entropy, scales)


objective_backward_op = torch.library.custom_op("erpo::triton_objective_backward", objective_backward,
                                                mutates_args=())


@objective_backward_op.register_fake
def _(grad_loss, token_kind, coef_logp, coef_entropy, scales):
    return torch.empty_like(coef_logp), torch.empty_like(coef_entropy)


def _setup_context(ctx, inputs, output):
    token_kind = inputs[2]
    coef_logp, coef_entropy, scales = output[5:]
    ctx.save_for_backward(token_kind, coef_logp, coef_entropy, scales)
    ctx.has_entropy = inputs[1] is not None
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, *_unused):
    token_kind, coef_logp, coef_entropy, scales = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 16
    grad_logp, grad_entropy = _objective_backward(grad_loss.float().contiguous(), token_kind, coef_logp,
                                                  coef_entropy, scales)
    return (grad_logp, grad_entropy if ctx.has_entropy else None) + (None,) * 14


objective_op.register_autograd(_backward, setup_context=_setup_context)
# What the loss calls: the ops under torch.compile, their implementations outside it (`direct_ops`).
_objective = DirectOp(objective_op, objective_forward, _setup_context, _backward)
_objective_backward = DirectOp(objective_backward_op, objective_backward)


def as_fp32(tensor):
    """`tensor` as fp32 and contiguous (itself when it is: no dispatch of the no-op `float` and `contiguous`, about
    1 us a tensor on the host), or None."""
    if tensor is None or (tensor.dtype == torch.float32 and tensor.is_contiguous()):
        return tensor
    return tensor.float().contiguous()


def fp32_loss_tensors(inputs: LossInputs) -> tuple:
    """The `LossInputs` tensors in their order, as the kernels read them: fp32, contiguous, or None."""
    return tuple([as_fp32(getattr(inputs, name)) for name in INPUT_NAMES])


def tensor_denominators(options: LossOptions) -> tuple:
    """(num_items, num_seqs), each a 1-element fp32 tensor when the option is a tensor, else None (a number or None
    travels in the settings)."""
    return tuple(as_fp32(value.reshape(1)) if isinstance(value, torch.Tensor) else None
                 for value in (options.num_items, options.num_seqs))


def triton_objective(token_logp: torch.Tensor, entropy: Optional[torch.Tensor], token_kind: torch.Tensor,
                     sample_index: torch.Tensor, *, inputs: LossInputs, options: LossOptions,
                     spans: Optional[torch.Tensor] = None) -> LossOutput:
    """`objective.erpo_objective` on these kernels, for options where `fuses(options, ...)` holds (the caller
    checks): token_logp [N] fp32 and entropy [N] fp32 or None (then the entropy metrics are absent and entropy_coef
    must be 0), both may require grad; token_kind, sample_index [N]; `inputs`, `options` validated; spans [2, S]:
    each sample's span of scored rows when the row checks found them (`triton_row_checks.RowChecksWithSpans`), else
    None (found here, `triton_segment.sample_spans`)."""
    token_kind, sample_index, spans = objective_rows(token_kind, sample_index, spans, inputs.advantages.shape[0])
    loss, query_logp, response_logp, metrics, counts, *_ = _objective(
        token_logp.contiguous(), None if entropy is None else entropy.contiguous(), token_kind, sample_index, spans,
        *objective_arguments(entropy, token_kind, inputs, options))
    return loss_output(loss, token_logp, entropy, query_logp, response_logp, metrics, counts, inputs, options)


def objective_rows(token_kind: torch.Tensor, sample_index: torch.Tensor, spans: Optional[torch.Tensor],
                   num_samples: int) -> tuple:
    """(token_kind, sample_index, spans) as the objective's kernels take them: contiguous, and spans [2, S] found
    here (`triton_segment.sample_spans`) when None (rows of kind 0 belong to no span, whatever their index)."""
    token_kind, sample_index = token_kind.contiguous(), sample_index.contiguous()
    if spans is None:
        spans = triton_sample_spans(sample_index, num_samples, token_kind)
    return token_kind, sample_index, spans


def objective_arguments(entropy: Optional[torch.Tensor], token_kind: torch.Tensor, inputs: LossInputs,
                        options: LossOptions, settings: Optional[List[float]] = None) -> tuple:
    """`objective_forward`'s arguments after the spans: the `LossInputs` tensors in fp32, the tensor denominators,
    the entropy filter's threshold (its (1 - top_entropy_quantile)-quantile of the detached entropies, else None) and
    the settings (`objective_settings`, unless given)."""
    entropy_threshold = None
    if options.top_entropy_quantile < 1.0:
        entropy_threshold = masked_quantile_op(entropy.detach().contiguous(), token_kind, 2,
                                               1.0 - options.top_entropy_quantile)
    if settings is None:
        settings = objective_settings(options, inputs, entropy is not None)
    return (*fp32_loss_tensors(inputs), *tensor_denominators(options), entropy_threshold, settings)


def loss_output(loss, token_logp, entropy, query_logp, response_logp, metrics, counts, inputs: LossInputs,
                options: LossOptions) -> LossOutput:
    """The LossOutput of the objective's outputs (loss [], query_logp, response_logp [S], the metrics and counts
    vectors) for token_logp and entropy [N] (or None: NaN entropies, the entropy metrics absent)."""
    slots = metric_slots(objective.applicable_metrics(inputs, options, has_entropy=entropy is not None))
    detached_entropy = torch.full_like(token_logp, float("nan")) if entropy is None else entropy.detach()
    return loss_output_in_slots(loss, token_logp.detach(), detached_entropy, query_logp, response_logp, metrics,
                                counts, slots)


def loss_output_in_slots(loss, token_logp, entropy, query_logp, response_logp, metrics, counts,
                         slots: Tuple[Optional[int], ...]) -> LossOutput:
    """`loss_output` with the metrics' places given (`metric_slots`; `ObjectivePlan.metric_slots`) and token_logp,
    entropy [N] that carry no gradient (detached, or made without one: the one-node loss's, whose two detaches
    were two more dispatches a call): LossMetrics filled by position, as `LossMetrics.for_call` fills it by name,
    on its first read (`SlotMetrics`)."""
    return LossOutput(loss=loss, token_logp=token_logp, query_logp=query_logp, response_logp=response_logp,
                      entropy=entropy, metrics=SlotMetrics.of(metrics, counts, slots))


def slot_fields(metrics: torch.Tensor, counts: torch.Tensor, slots: Tuple[Optional[int], ...]) -> dict:
    """{LossMetrics field: 0-dim view of metrics [len(FLOAT_METRICS)] or counts [len(COUNT_METRICS)], or None} by
    `metric_slots`' places (FLOAT_METRICS, then COUNT_METRICS)."""
    values = metrics.unbind() + counts.unbind()
    return {name: None if slot is None else values[slot] for name, slot in zip(objective.METRIC_NAMES, slots)}


class SlotMetrics(LossMetrics):
    """A LossMetrics whose fields, 0-dim views of the finish kernel's metrics and counts vectors (FLOAT_METRICS, then
    COUNT_METRICS) placed by `metric_slots`, are made when one is first read (as an attribute, by name, or by
    `dataclasses`): a loss call queues its kernels without making them (two unbinds and the record, about 10 us of
    host time a call, `python -m bench.host_cost`). Once made, the record is LossMetrics' own, field for field."""

    @classmethod
    def of(cls, metrics: torch.Tensor, counts: torch.Tensor, slots: Tuple[Optional[int], ...]) -> LossMetrics:
        if torch.compiler.is_compiling():  # Dynamo cannot trace the first read's __delattr__: the fields made now
            return LossMetrics(**slot_fields(metrics, counts, slots))
        record = object.__new__(cls)
        object.__setattr__(record, "_vectors", (metrics, counts, slots))
        return record

    def __getattr__(self, name: str):  # reached only for what the instance does not hold: its fields before a read
        vectors = self.__dict__.get("_vectors")
        if vectors is None or name not in objective.METRIC_NAMES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        for field_name, value in slot_fields(*vectors).items():
            object.__setattr__(self, field_name, value)
        object.__delattr__(self, "_vectors")
        return getattr(self, name)
