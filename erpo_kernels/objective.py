"""The ERPO loss on per-token vectors: everything after the [N, V] pass.

Given the per-token log-probabilities `token_logp` [N] and entropies [N] (differentiable), this module forms
ell_theta(q), the Query-KL, the weighted clipped policy-gradient term and their aggregation, exactly as
API.md's "math" section. Both the logits path and the fused-linear path call it, so the loss is written once.
The gradient it sends back into `token_logp` and `entropy` is the per-token coefficient the fused backward
kernels turn into dlogits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .segment import SegmentSum
from .validation import LossInputs, LossOptions


@dataclass
class LossOutput:
    """Result of `erpo_loss` / `fused_linear_erpo_loss`.

    loss: 0-dim, differentiable. token_logp [N] fp32, query_logp [S], response_logp [S], entropy [N] fp32:
    detached. metrics: detached 0-dim tensors (qkl, policy_kl, entropy, clip_frac, pg_loss, nonfinite_rows, ...).
    """

    loss: torch.Tensor
    token_logp: torch.Tensor
    query_logp: torch.Tensor
    response_logp: torch.Tensor
    entropy: torch.Tensor
    metrics: dict = field(default_factory=dict)


def kl_estimate(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL estimators on r = log(p_ref / p_theta): k1 = -r, k2 = r^2 / 2, k3 = exp(r) - r - 1."""
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(log_ratio) - log_ratio


def kl_slope(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """d estimator / d r of `kl_estimate`: k1 -> -1, k2 -> r, k3 -> exp(r) - 1."""
    if estimator == "k1":
        return torch.full_like(log_ratio, -1.0)
    if estimator == "k2":
        return log_ratio
    return torch.expm1(log_ratio)


def linear_beyond(log_ratio: torch.Tensor, estimator: str, limit: float) -> torch.Tensor:
    """The sequence-level Query-KL estimator: exact for |r| <= limit, continued along its tangent beyond (value and
    slope matched at +-limit, so C1):

        f(r) = k(r)                                   |r| <= limit
        f(r) = k(+-limit) + k'(+-limit) (r -+ limit)  beyond

    Its slope is bounded by |k'(+-limit)| for any drift (k3: e^limit - 1 above, 1 - e^-limit below; k2: limit; k1 is
    already linear, so unchanged), never 0 beyond the limit the way a clamp of r is, and its value stays finite
    (k2, k3: growing linearly in |r| beyond the limit)."""
    inside = log_ratio.clamp(-limit, limit)
    return kl_estimate(inside, estimator) + kl_slope(inside, estimator) * (log_ratio - inside)


def _safe_div(numerator: torch.Tensor, denominator) -> torch.Tensor:
    if isinstance(denominator, torch.Tensor):
        return numerator / denominator.to(numerator).clamp_min(1)
    return numerator / max(float(denominator), 1.0)


def erpo_objective(token_logp, entropy, token_kind, sample_index, *, inputs: LossInputs, options: LossOptions,
                   segment_sum=SegmentSum) -> LossOutput:
    """ERPO loss from token_logp [N] fp32 and entropy [N] fp32 (both may require grad).

    token_kind [N] (0 not scored, 1 query, 2 response), sample_index [N] in [0, S) on scored rows; `inputs`
    (validated): advantages [S], ref_query_logp [S] or None, query_weight [S] or None (= 1), old_logp [N] or None
    (= on-policy), ref_logp [N] or None, token_weight [N] or None (= 1; multiplies pg_t like w_s), rollout_logp
    [N] or None (the rollout engine's sampling log-probs: pg_t is then also multiplied by the truncated
    importance-sampling weight min(exp(old_logp_t - rollout_logp_t), rollout_is_cap)).
    `segment_sum(sample_index, num_samples)` builds the per-sample sums (`SegmentSum`'s interface).
    """
    opts = options
    advantages, ref_query_logp, ref_logp = inputs.advantages, inputs.ref_query_logp, inputs.ref_logp
    num_samples = advantages.shape[0]
    is_query = token_kind == 1
    is_response = token_kind == 2
    sample = torch.where(token_kind != 0, sample_index.long(), torch.zeros_like(sample_index, dtype=torch.long))
    zero = torch.zeros((), dtype=torch.float32, device=token_logp.device)
    sample_sum = segment_sum(sample, num_samples)
    num_response = is_response.sum()

    def per_sample_sum(values, rows):
        return sample_sum(torch.where(rows, values, zero))

    def response_mean(values):
        return torch.where(is_response, values, zero).sum() / num_response.clamp_min(1)

    def response_max(values):  # of values >= 0; 0 without response rows
        return torch.where(is_response, values, zero).amax() if values.numel() else zero

    def kl_value(kl):  # the estimate clamped when kl_clamp is set
        return kl if opts.kl_clamp is None else kl.clamp(-opts.kl_clamp, opts.kl_clamp)

    def k3_against_reference(rows):  # per-token k3(ref_logp - logp clamped to +-log_ratio_clamp) on `rows`, 0 else
        log_ratio = torch.where(rows, ref_logp.float() - token_logp, zero)
        return kl_value(kl_estimate(log_ratio.clamp(-opts.log_ratio_clamp, opts.log_ratio_clamp), "k3"))

    query_logp = per_sample_sum(token_logp, is_query)          # ell_theta(q)
    response_logp = per_sample_sum(token_logp, is_response)
    query_rows = sample_sum(is_query.float())  # row counts (exact in fp32 below 2^24), no host-device sync
    response_rows = sample_sum(is_response.float())

    # Policy-gradient term on response rows.
    advantage = advantages.float()[sample]
    old = token_logp.detach() if inputs.old_logp is None else inputs.old_logp.float()
    log_ratio = torch.where(is_response, token_logp - old, zero)
    if opts.ratio_level == "sequence":  # GSPO: one ratio per sample, from the mean log-ratio over its response rows
        mean_log_ratio = per_sample_sum(log_ratio, is_response) / response_rows.clamp_min(1)
        log_ratio = torch.where(is_response, mean_log_ratio[sample], zero)
    if opts.pg_log_ratio_clamp is not None:  # verl's clamp of log(ratio) to [-20, 20] before exp
        log_ratio = log_ratio.clamp(-opts.pg_log_ratio_clamp, opts.pg_log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -advantage * ratio
    clipped = -advantage * ratio.clamp(1.0 - opts.clip_low, 1.0 + opts.clip_high)
    pg = torch.maximum(unclipped, clipped)
    if opts.dual_clip is not None:
        pg = torch.where(advantage < 0, torch.minimum(pg, -advantage * opts.dual_clip), pg)
    if inputs.query_weight is not None:
        pg = inputs.query_weight.float()[sample] * pg
    if inputs.token_weight is not None:
        pg = inputs.token_weight.float() * pg
    rollout_is_weight = rollout_gap = None
    if inputs.rollout_logp is not None:  # truncated importance sampling: trainer vs rollout-engine log-probs
        rollout_gap = torch.where(is_response, old - inputs.rollout_logp.float(), zero)
        rollout_is_weight = torch.exp(rollout_gap.clamp(max=math.log(opts.rollout_is_cap)))
        pg = rollout_is_weight * pg
    term = pg
    policy_kl = None if ref_logp is None else k3_against_reference(is_response)
    if policy_kl is not None and opts.policy_kl_bias_correction:  # TRL's use_bias_correction_kl: times the ratio,
        policy_kl = ratio * policy_kl                                 # not detached
    if opts.policy_kl_coef != 0:
        term = term + opts.policy_kl_coef * policy_kl
    if opts.entropy_coef != 0 and opts.entropy_agg == "loss-agg":
        term = term - opts.entropy_coef * entropy

    # Aggregation over response rows.
    if opts.loss_agg == "token-mean":
        num_items = num_response if opts.num_items is None else opts.num_items
        aggregate = lambda values: _safe_div(torch.where(is_response, values, zero).sum(), num_items)  # noqa: E731
    else:
        has_response = response_rows > 0
        num_seqs = has_response.sum() if opts.num_seqs is None else opts.num_seqs

        def aggregate(values):
            per_sample = per_sample_sum(values, is_response)
            if opts.loss_agg == "seq-mean-token-mean":
                per_sample = per_sample / response_rows.clamp_min(1)
            return _safe_div(torch.where(has_response, per_sample, zero).sum(), num_seqs)
    pg_part = aggregate(term)
    if opts.entropy_coef != 0 and opts.entropy_agg == "token-mean":  # TRL's entropy bonus, whatever loss_agg
        pg_part = pg_part - opts.entropy_coef * response_mean(entropy)

    # Query-KL on samples that have query rows.
    has_query = query_rows > 0
    num_query_seqs = has_query.sum() if opts.num_seqs is None else opts.num_seqs
    qkl = None
    if opts.qkl_estimator == "k3-token":
        if ref_logp is not None:
            qkl_per_sample = per_sample_sum(k3_against_reference(is_query), is_query) / query_rows.clamp_min(1)
            qkl = _safe_div(torch.where(has_query, qkl_per_sample, zero).sum(), num_query_seqs)
    elif ref_query_logp is not None:
        # A whole prompt's log-ratio: not clamped (a clamp zeroes the gradient once the prompt drifts that far),
        # but its estimator continued linearly beyond qkl_linear_beyond (bounded, never zero, restoring gradient).
        qkl_per_sample = kl_value(linear_beyond(ref_query_logp.float() - query_logp, opts.qkl_estimator,
                                                opts.qkl_linear_beyond))
        qkl = _safe_div(torch.where(has_query, qkl_per_sample, zero).sum(), num_query_seqs)
    loss = pg_part
    if opts.qkl_coef != 0:
        loss = loss + opts.qkl_coef * qkl
    # A non-finite scored row makes the loss NaN (and is counted in metrics), even when no term reads it.
    nan = torch.full((), float("nan"), device=token_logp.device)
    with torch.no_grad():
        nonfinite = (token_kind != 0) & ~(torch.isfinite(token_logp) & torch.isfinite(entropy))
    loss = loss + torch.where(nonfinite.any(), nan, zero)

    with torch.no_grad():
        clip_taken = is_response & (clipped > unclipped)
        metrics = {
            "qkl": nan if qkl is None else qkl.detach(),
            "policy_kl": nan if policy_kl is None else response_mean(policy_kl.detach()),
            "entropy": response_mean(entropy.detach()),
            "clip_frac": response_mean(clip_taken.float()),
            "pg_loss": aggregate(pg.detach()),
            "ratio_mean": response_mean(ratio.detach()),
            "query_logp_mean": (query_logp.detach() * has_query).sum() / has_query.sum().clamp_min(1),
            "rollout_is_weight": nan if rollout_is_weight is None else response_mean(rollout_is_weight),
            "rollout_logp_gap_abs": nan if rollout_gap is None else response_mean(rollout_gap.abs()),
            "rollout_logp_gap_max": nan if rollout_gap is None else response_max(rollout_gap.abs()),
            "response_tokens": num_response,
            "nonfinite_rows": nonfinite.sum(),
        }
    return LossOutput(loss=loss, token_logp=token_logp.detach(), query_logp=query_logp.detach(),
                      response_logp=response_logp.detach(), entropy=entropy.detach(), metrics=metrics)
