"""The ERPO loss on per-token vectors: everything after the [N, V] pass.

Given the per-token log-probabilities `token_logp` [N] and entropies [N] (differentiable), this module forms
ell_theta(q), the Query-KL, the weighted policy-gradient term (PPO's clipped surrogate, or CISPO / SAPO / VESPO
as TRL computes them; TRL's off-policy mask and entropy filter) and their aggregation, exactly as API.md's "math"
section. Both the logits path and the fused-linear path call it, so the loss is written once.
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


# The per-token policy terms (`pg_objective`), each as TRL 1.16's GRPOTrainer._compute_loss writes it for its loss
# type: A_s [N] is the row's sample's advantage, ratio [N] the PG ratio (token or sequence level), logp [N] the
# current log-probs. Each returns (pg [N], rows where a clip or truncation changed the term [N] bool).

def clipped_surrogate(advantage, ratio, clip_low: float, clip_high: float, dual_clip: float | None):
    """PPO: max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high)), capped at -A * dual_clip when A < 0."""
    unclipped = -advantage * ratio
    clipped = -advantage * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        pg = torch.where(advantage < 0, torch.minimum(pg, -advantage * dual_clip), pg)
    return pg, clipped > unclipped


def cispo_term(advantage, ratio, logp, clip_max: float):
    """CISPO (MiniMax-M1): -sg(min(ratio, clip_max)) * A * logp: REINFORCE weighted by the truncated, detached
    importance weight, so no token's gradient is clipped away (gradient -min(ratio, clip_max) * A per d logp)."""
    weight = ratio.detach().clamp(max=clip_max)
    return -weight * advantage * logp, ratio.detach() > clip_max


def sapo_term(advantage, ratio, temperature_pos: float, temperature_neg: float):
    """SAPO: -A * (4 / tau) * sigmoid(tau * (ratio - 1)), tau = temperature_pos if A > 0 else temperature_neg: a soft
    gate whose gradient, -A * 4 sigmoid (1 - sigmoid) * ratio per d logp, is -A * ratio at ratio = 1 and decays
    smoothly away from it. Never clipped."""
    tau = torch.where(advantage > 0, ratio.new_tensor(temperature_pos), ratio.new_tensor(temperature_neg))
    return -advantage * torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau, torch.zeros_like(ratio, dtype=torch.bool)


VESPO_LOG_RATIO_CLAMP = 20.0          # TRL clamps each token's log-ratio, and the sequence's log-weight, to 20
VESPO_LOG_WEIGHT_MIN = math.log(1e-8)  # and the log-weights (sequence, rollout correction) from below at log(1e-8)


def vespo_gamma_weight(advantage_s, log_weight_s, k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float):
    """VESPO's phi(w) = exp(lambda + k log w - lambda w) per sample (phi(1) = 1), (k, lambda) = (k_pos, lambda_pos)
    where A_s >= 0 else (k_neg, lambda_neg); log_weight_s [S] = log w, already clamped. Detached, non-finite -> 0
    (as TRL's get_gamma_weights)."""
    nonneg = advantage_s >= 0
    k = torch.where(nonneg, log_weight_s.new_tensor(k_pos), log_weight_s.new_tensor(k_neg))
    lam = torch.where(nonneg, log_weight_s.new_tensor(lambda_pos), log_weight_s.new_tensor(lambda_neg))
    log_phi = lam + k * log_weight_s - lam * torch.exp(log_weight_s)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()


def masked_quantile(values: torch.Tensor, rows: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(values[rows], q) (linear interpolation) with static shapes and no data-dependent control flow,
    so torch.compile(fullgraph=True) traces it whole: values [N] (N >= 1), rows [N] bool, q in [0, 1]; returns a
    0-dim fp32 tensor, NaN when no row is pooled or a pooled value is NaN (as torch.quantile's NaN).

    The rows outside the pool sort to +inf behind the n pooled values, so the pool's order statistics are the first
    n of the sorted vector; then, as torch.quantile does it (bit for bit: same fp32 rank, same lerp), rank =
    q (n - 1), and the quantile lerps between the order statistics at floor(rank) and ceil(rank) (both <= n - 1)."""
    pooled = torch.where(rows, values.float(), float("inf")).sort().values
    count = rows.sum()
    rank = (pooled.new_tensor(q) * (count - 1)).clamp_min(0)  # n = 0: rank 0 (the result is NaN below)
    below = rank.long()
    order_statistics = pooled.gather(0, torch.stack([below, rank.ceil().long()]))
    quantile = torch.lerp(order_statistics[0], order_statistics[1], rank - below)
    undefined = (count == 0) | (rows & values.isnan()).any()
    return torch.where(undefined, float("nan"), quantile)


def high_entropy_mask(entropy, rows, top_quantile: float, gather=None):
    """TRL's entropy filter (top_entropy_quantile, "Beyond the 80/20 rule"): bool [N], True on the `rows` whose
    entropy is >= the (1 - top_quantile)-quantile (torch.quantile, linear interpolation) of the entropies of `rows`
    (of every process when `gather` maps this call's [n] fp32 entropies to all processes' [m]). No row is kept when
    there is none to take the quantile of, or when one of them has a NaN entropy (the quantile is then NaN).
    entropy [N] (nats; read detached), rows [N] bool. Without `gather` the shapes are static (`masked_quantile`:
    torch.compile needs no graph break); with it the pool's length is data-dependent."""
    entropy = entropy.detach()
    if gather is None:
        if entropy.numel() == 0:
            return torch.zeros_like(rows)
        return rows & (entropy >= masked_quantile(entropy, rows, 1 - top_quantile))
    pool = gather(entropy[rows].float())
    if pool.numel() == 0:
        return torch.zeros_like(rows)
    return rows & (entropy >= torch.quantile(pool, 1 - top_quantile))


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

    # Policy-gradient term on response rows, in fp32 (fp64 for fp64 log-probs: the float64 tests).
    real = torch.float64 if token_logp.dtype == torch.float64 else torch.float32
    advantage = advantages.to(real)[sample]
    old = token_logp.detach() if inputs.old_logp is None else inputs.old_logp.to(real)
    token_log_ratio = torch.where(is_response, token_logp - old, zero)
    log_ratio = token_log_ratio
    if opts.ratio_level == "sequence":  # GSPO: one ratio per sample, from the mean log-ratio over its response rows
        mean_log_ratio = per_sample_sum(log_ratio, is_response) / response_rows.clamp_min(1)
        log_ratio = torch.where(is_response, mean_log_ratio[sample], zero)
    if opts.pg_log_ratio_clamp is not None:  # verl's clamp of log(ratio) to [-20, 20] before exp
        log_ratio = log_ratio.clamp(-opts.pg_log_ratio_clamp, opts.pg_log_ratio_clamp)
        token_log_ratio = token_log_ratio.clamp(-opts.pg_log_ratio_clamp, opts.pg_log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    rollout_is_weight = rollout_gap = log_rollout_is_weight = None
    if inputs.rollout_logp is not None:  # truncated importance sampling: trainer vs rollout-engine log-probs
        rollout_gap = torch.where(is_response, old - inputs.rollout_logp.to(real), zero)
        if opts.rollout_is_cap is not None:
            log_rollout_is_weight = rollout_gap.clamp(max=math.log(opts.rollout_is_cap))
            rollout_is_weight = torch.exp(log_rollout_is_weight)
    vespo_phi = None
    if opts.pg_objective == "ppo-clip":
        pg, clip_taken = clipped_surrogate(advantage, ratio, opts.clip_low, opts.clip_high, opts.dual_clip)
    elif opts.pg_objective == "cispo":
        pg, clip_taken = cispo_term(advantage, ratio, token_logp, opts.cispo_clip_max)
    elif opts.pg_objective == "sapo":
        pg, clip_taken = sapo_term(advantage, ratio, opts.sapo_temperature_pos, opts.sapo_temperature_neg)
    else:  # vespo: w_s = prod over response rows of ratio_t (token level whatever ratio_level) and the rollout
        # correction, each token's log clamped, then log w_s clamped to [log 1e-8, 20]; pg_t = -phi(w_s) * A_s * logp_t
        clamp = VESPO_LOG_RATIO_CLAMP
        log_weight = per_sample_sum(token_log_ratio.detach().clamp(-clamp, clamp), is_response)
        if log_rollout_is_weight is not None:  # TRL folds the rollout correction into w_s (it does not multiply pg_t)
            log_weight = log_weight + per_sample_sum(log_rollout_is_weight.clamp(VESPO_LOG_WEIGHT_MIN, clamp),
                                                     is_response)
        vespo_phi = vespo_gamma_weight(advantages.to(real), log_weight.clamp(VESPO_LOG_WEIGHT_MIN, clamp),
                                       opts.vespo_k_pos, opts.vespo_lambda_pos, opts.vespo_k_neg, opts.vespo_lambda_neg)
        pg, clip_taken = -vespo_phi[sample] * advantage * token_logp, torch.zeros_like(is_response)
    if inputs.query_weight is not None:
        pg = inputs.query_weight.to(real)[sample] * pg
    if inputs.token_weight is not None:
        pg = inputs.token_weight.to(real) * pg
    if rollout_is_weight is not None and opts.pg_objective != "vespo":
        pg = rollout_is_weight * pg
    off_policy_kept = None
    if opts.off_policy_mask_threshold is not None:  # DeepSeek-V3.2's off-policy sequence mask, as TRL: drop a
        # sample with A_s < 0 whose mean over response rows of (behaviour - current) log-prob exceeds the threshold
        behaviour = old if inputs.rollout_logp is None else inputs.rollout_logp.to(real)
        drift = per_sample_sum(behaviour - token_logp.detach(), is_response) / response_rows.clamp_min(1)
        off_policy_kept = ((advantages.to(real) >= 0) | (drift <= opts.off_policy_mask_threshold))[sample]
        pg = off_policy_kept * pg
    entropy_kept = is_response
    if opts.top_entropy_quantile < 1.0:  # TRL's entropy filter: policy term (and entropy bonus) on the
        entropy_kept = high_entropy_mask(entropy, is_response, opts.top_entropy_quantile,  # top entropy rows only
                                         opts.top_entropy_gather)
        pg = entropy_kept * pg
    kept_rows = entropy_kept.sum()  # the rows keeping pg_t and the entropy bonus (all response rows without a filter)
    term = pg
    policy_kl = None if ref_logp is None else k3_against_reference(is_response)
    if policy_kl is not None and opts.policy_kl_bias_correction:  # TRL's use_bias_correction_kl: times the ratio,
        policy_kl = ratio * policy_kl                                 # not detached
    if opts.policy_kl_coef != 0:
        term = term + opts.policy_kl_coef * policy_kl
    if opts.entropy_coef != 0 and opts.entropy_agg == "loss-agg":
        term = term - opts.entropy_coef * torch.where(entropy_kept, entropy, zero)

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
    if opts.entropy_coef != 0 and opts.entropy_agg == "token-mean":  # TRL's entropy bonus, whatever loss_agg: the
        # mean of H_t over the rows the entropy filter keeps
        pg_part = pg_part - opts.entropy_coef * torch.where(entropy_kept, entropy, zero).sum() / kept_rows.clamp_min(1)

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
        clip_taken = is_response & clip_taken
        has_response_rows = response_rows > 0
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
            "off_policy_masked_frac": nan if off_policy_kept is None else response_mean((~off_policy_kept).float()),
            "kept_tokens": kept_rows,
            "kept_entropy": torch.where(entropy_kept, entropy.detach(), zero).sum() / kept_rows.clamp_min(1),
            "vespo_phi_mean": nan if vespo_phi is None else
            (vespo_phi * has_response_rows).sum() / has_response_rows.sum().clamp_min(1),
        }
    return LossOutput(loss=loss, token_logp=token_logp.detach(), query_logp=query_logp.detach(),
                      response_logp=response_logp.detach(), entropy=entropy.detach(), metrics=metrics)
