"""The ERPO loss on per-token vectors: everything after the [N, V] pass.

Given the per-token log-probabilities `token_logp` [N] and entropies [N] (differentiable), `erpo_objective` forms
the loss of API.md's "math" section in named stages: the rows' per-sample statistics (`TokenRows`: ell_theta(q) and
the row counts), the policy term (`policy_term`: ratio_t, pg_t of the chosen objective (PPO's clipped surrogate, or
CISPO / SAPO / VESPO as TRL computes them), its weights, TRL's off-policy mask and entropy filter, the Policy-KL),
term_t and its aggregation (`aggregation`), the Query-KL (`query_kl`) and the metrics (`loss_metrics`, a typed
`LossMetrics`). Both the logits path and the fused-linear path call it, so the loss is written once; it is the
readable oracle the Triton objective is tested against. The gradient it sends back into `token_logp` and `entropy`
is the per-token coefficient the fused backward kernels turn into dlogits.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from .segment import SegmentSum
from .validation import LossInputs, LossOptions


@dataclass(frozen=True, eq=False)
class LossMetrics(Mapping):
    """The loss's metrics: each a detached 0-dim tensor (fp32, or fp64 where the loss is fp64; the counts int64).
    Read as attributes or as a read-only mapping by name (`metrics["qkl"]`, `dict(metrics)`, `metrics.items()`,
    `"qkl" in metrics`). "Response rows" are the rows of token_kind 2 in this call. A metric that does not apply to
    the call (its option or input is absent: `applicable_metrics`, decided from them, never from values) is absent:
    its attribute is None, the mapping leaves it out (`in`, `dict`, iteration, `len`) and `metrics[name]` raises a
    KeyError saying what it needs. A NaN is a value: a non-finite row in what the metric reads.

    qkl: the Query-KL as it enters the loss, sum over samples with query rows of qkl_s / num_seqs (nats; absent without
        the reference it needs: ref_query_logp, or ref_logp for "k3-token").
    policy_kl: mean over response rows of the Policy-KL k3(ref_logp_t - logp_t) as it enters term_t (times ratio_t
        under policy_kl_bias_correction, as TRL logs `kl`) (nats; absent without ref_logp).
    entropy: mean of H_t over response rows (nats; TRL's `entropy`; absent when no entropy is given:
        `logprob_erpo_loss` without entropy).
    clip_frac: fraction of response rows where a clip or truncation changed pg_t (ppo-clip: the clipped branch;
        cispo: ratio_t > cispo_clip_max; 0 with sapo and vespo).
    pg_loss: the policy-gradient part alone (pg_t after its weights and masks, without the Policy-KL and the entropy
        bonus), aggregated as the loss (`loss_agg`).
    ratio_mean: mean of ratio_t over response rows (token or sequence level as `ratio_level`; dimensionless).
    query_logp_mean: mean of ell_theta(q) over samples with query rows (nats per query: a sum over its tokens).
    rollout_is_weight: mean over response rows of rho_t = min(exp(old_logp_t - rollout_logp_t), rollout_is_cap)
        (dimensionless; absent without rollout_logp or with rollout_is_cap None).
    rollout_logp_gap_abs, rollout_logp_gap_max: mean and max over response rows of |old_logp_t - rollout_logp_t|
        (nats; absent without rollout_logp).
    response_tokens: the number of response rows (int64).
    nonfinite_rows: the scored rows (token_kind != 0) whose logp_t or H_t is not finite (int64; > 0 makes the loss
        NaN).
    off_policy_masked_frac: fraction of response rows whose sample the off-policy mask drops (absent without
        off_policy_mask_threshold).
    kept_tokens: the response rows the entropy filter keeps (all of them without it) (int64).
    kept_entropy: mean of H_t over those rows (nats); with kept_tokens, the inputs of TRL's adaptive entropy
        controller (absent when no entropy is given).
    vespo_phi_mean: mean of phi_s over samples with response rows (dimensionless; absent unless pg_objective "vespo").
    """

    qkl: torch.Tensor | None
    policy_kl: torch.Tensor | None
    entropy: torch.Tensor | None
    clip_frac: torch.Tensor
    pg_loss: torch.Tensor
    ratio_mean: torch.Tensor
    query_logp_mean: torch.Tensor
    rollout_is_weight: torch.Tensor | None
    rollout_logp_gap_abs: torch.Tensor | None
    rollout_logp_gap_max: torch.Tensor | None
    response_tokens: torch.Tensor
    nonfinite_rows: torch.Tensor
    off_policy_masked_frac: torch.Tensor | None
    kept_tokens: torch.Tensor
    kept_entropy: torch.Tensor | None
    vespo_phi_mean: torch.Tensor | None

    @classmethod
    def for_call(cls, values: Mapping, inputs: LossInputs, options: LossOptions, *,
                 has_entropy: bool = True) -> LossMetrics:
        """The record of one call: values[name] (a 0-dim tensor) for each metric that applies to it
        (`applicable_metrics`), None for the others (`values` need not hold them)."""
        applicable = applicable_metrics(inputs, options, has_entropy=has_entropy)
        return cls(**{name: values[name] if name in applicable else None for name in METRIC_NAMES})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in METRIC_NAMES:
            raise KeyError(name)
        value = getattr(self, name)
        if value is None:
            raise KeyError(f"{name} does not apply to this call: it needs {METRIC_NEEDS[name]}")
        return value

    def __iter__(self):
        return (name for name in METRIC_NAMES if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(getattr(self, name) is not None for name in METRIC_NAMES)


METRIC_NAMES = tuple(f.name for f in fields(LossMetrics))  # LossMetrics' fields, in order

# The metrics that apply only to some calls, each with what it needs (the KeyError of reading one without says so).
METRIC_NEEDS = {
    "qkl": "ref_query_logp (ref_logp with qkl_estimator 'k3-token')",
    "policy_kl": "ref_logp",
    "entropy": "the entropies (logprob_erpo_loss's entropy=)",
    "rollout_is_weight": "rollout_logp and a rollout_is_cap",
    "rollout_logp_gap_abs": "rollout_logp",
    "rollout_logp_gap_max": "rollout_logp",
    "off_policy_masked_frac": "off_policy_mask_threshold",
    "kept_entropy": "the entropies (logprob_erpo_loss's entropy=)",
    "vespo_phi_mean": "pg_objective 'vespo'",
}


def applicable_metrics(inputs: LossInputs, options: LossOptions, *, has_entropy: bool = True) -> tuple[str, ...]:
    """The names of the metrics that apply to a call with these inputs and options (`has_entropy`: whether the
    per-token entropies were given), in METRIC_NAMES' order: every metric but those of METRIC_NEEDS whose need is
    not met. Decided from which inputs and options are there, never from values (a NaN in a value stays a value)."""
    has_rollout = inputs.rollout_logp is not None
    qkl_reference = inputs.ref_logp if options.qkl_estimator == "k3-token" else inputs.ref_query_logp
    met = {"qkl": qkl_reference is not None, "policy_kl": inputs.ref_logp is not None, "entropy": has_entropy,
           "rollout_is_weight": has_rollout and options.rollout_is_cap is not None,
           "rollout_logp_gap_abs": has_rollout, "rollout_logp_gap_max": has_rollout,
           "off_policy_masked_frac": options.off_policy_mask_threshold is not None, "kept_entropy": has_entropy,
           "vespo_phi_mean": options.pg_objective == "vespo"}
    return tuple(name for name in METRIC_NAMES if name not in METRIC_NEEDS or met[name])


@dataclass
class LossOutput:
    """Result of `erpo_loss` / `fused_linear_erpo_loss`.

    loss: 0-dim, differentiable. token_logp [N] fp32, query_logp [S], response_logp [S], entropy [N] fp32:
    detached. metrics: `LossMetrics` (detached 0-dim tensors: qkl, policy_kl, entropy, clip_frac, pg_loss, ...).
    """

    loss: torch.Tensor
    token_logp: torch.Tensor
    query_logp: torch.Tensor
    response_logp: torch.Tensor
    entropy: torch.Tensor
    metrics: LossMetrics


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
    q (n - 1), and the quantile lerps between the order statistics at floor(rank) and ceil(rank) (both <= n - 1).
    The rank is fp32 as torch.quantile's, exact for n <= 2^24 (the most torch.quantile accepts)."""
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
    # masked_quantile over the whole pool rather than torch.quantile: the same value bit for bit, without the host
    # read torch 2.11's quantile makes (aten.equal)
    return rows & (entropy >= masked_quantile(pool, torch.ones_like(pool, dtype=torch.bool), 1 - top_quantile))


def _safe_div(numerator: torch.Tensor, denominator) -> torch.Tensor:
    """numerator / max(denominator, 1): a number, or a 1-element tensor of any shape (the result stays 0-dim)."""
    if isinstance(denominator, torch.Tensor):
        return numerator / denominator.to(numerator).reshape(()).clamp_min(1)
    return numerator / max(float(denominator), 1.0)


class TokenRows:
    """The batch's rows as the loss reads them and their per-sample statistics, built once per call.

    is_query, is_response [N] bool (token_kind 1, 2); sample [N] int64: each row's sample (0 on rows of kind 0, which
    every sum masks out); query_rows, response_rows [S] fp32: each sample's row counts (exact below 2^24; no
    host-device sync); has_query, has_response [S] bool; num_response, num_query_samples: 0-dim int64, the response
    rows and the samples with query rows; zero, nan: 0-dim fp32 constants on the rows' device.
    `segment_sum(sample, S)` builds the per-sample sums (`SegmentSum`'s interface)."""

    def __init__(self, token_kind, sample_index, num_samples: int, segment_sum):
        self.is_query = token_kind == 1
        self.is_response = token_kind == 2
        unscored_sample = torch.zeros_like(sample_index, dtype=torch.long)
        self.sample = torch.where(token_kind != 0, sample_index.long(), unscored_sample)
        self.zero = torch.zeros((), dtype=torch.float32, device=token_kind.device)
        self.nan = torch.full((), float("nan"), device=token_kind.device)
        self.sample_sum = segment_sum(self.sample, num_samples)
        self.num_response = self.is_response.sum()
        self._response_divisor = self.num_response.clamp_min(1)  # of every mean over response rows
        self.query_rows = self.sample_sum(self.is_query.float())
        self.response_rows = self.sample_sum(self.is_response.float())
        self.has_query = self.query_rows > 0
        self.has_response = self.response_rows > 0
        self.num_query_samples = self.has_query.sum()

    def per_sample_sum(self, values, rows):
        """[S]: each sample's sum of values [N] over `rows` [N] bool."""
        return self.sample_sum(torch.where(rows, values, self.zero))

    def response_sample_mean(self, values):
        """[S]: each sample's mean of values [N] over its response rows (0 without any)."""
        return self.per_sample_sum(values, self.is_response) / self.response_rows.clamp_min(1)

    def response_mean(self, values):
        """0-dim: the mean of values [N] over all response rows (0 without any)."""
        return torch.where(self.is_response, values, self.zero).sum() / self._response_divisor

    def response_max(self, values):
        """0-dim: the max of values [N] >= 0 over all response rows (0 without any)."""
        return torch.where(self.is_response, values, self.zero).amax() if values.numel() else self.zero


def clamped_kl(kl: torch.Tensor, kl_clamp: float | None) -> torch.Tensor:
    """A KL value clamped to [-kl_clamp, kl_clamp] when `kl_clamp` is set."""
    return kl if kl_clamp is None else kl.clamp(-kl_clamp, kl_clamp)


def reference_k3(token_logp, ref_logp, rows: TokenRows, on, options: LossOptions):
    """[N]: the per-token k3(ref_logp_t - logp_t) on the rows `on` [N] bool (0 elsewhere), the log-ratio clamped to
    +-log_ratio_clamp and the value by kl_clamp (the Policy-KL on response rows, "k3-token" on query rows)."""
    log_ratio = torch.where(on, ref_logp.float() - token_logp, rows.zero)
    clamp = options.log_ratio_clamp
    return clamped_kl(kl_estimate(log_ratio.clamp(-clamp, clamp), "k3"), options.kl_clamp)


def policy_ratio(token_logp, old, rows: TokenRows, options: LossOptions):
    """(token_log_ratio [N], ratio [N]): logp_t - old_logp_t on response rows (0 elsewhere, then clamped to
    +-pg_log_ratio_clamp when set) and ratio_t = exp of it, or with ratio_level "sequence" (GSPO) exp of the mean
    log-ratio over the row's sample's response rows (1 off response rows)."""
    token_log_ratio = torch.where(rows.is_response, token_logp - old, rows.zero)
    log_ratio = token_log_ratio
    if options.ratio_level == "sequence":
        log_ratio = torch.where(rows.is_response, rows.response_sample_mean(log_ratio)[rows.sample], rows.zero)
    if options.pg_log_ratio_clamp is not None:  # verl's clamp of log(ratio) to [-20, 20] before exp
        log_ratio = log_ratio.clamp(-options.pg_log_ratio_clamp, options.pg_log_ratio_clamp)
        token_log_ratio = token_log_ratio.clamp(-options.pg_log_ratio_clamp, options.pg_log_ratio_clamp)
    return token_log_ratio, torch.exp(log_ratio)


class RolloutCorrection(NamedTuple):
    """Truncated importance sampling against the rollout engine's log-probs, [N] on response rows (0 elsewhere):
    gap = old_logp_t - rollout_logp_t; log_weight, weight: log rho_t and rho_t = min(exp(gap), rollout_is_cap)
    (None when rollout_is_cap is None: the gap then feeds the metrics and the off-policy mask only)."""

    gap: torch.Tensor
    log_weight: torch.Tensor | None
    weight: torch.Tensor | None


def rollout_correction(old, rollout_logp, rows: TokenRows, options: LossOptions, real) -> RolloutCorrection:
    """`RolloutCorrection` from old_logp [N] (the current log-prob when on-policy) and rollout_logp [N]."""
    gap = torch.where(rows.is_response, old - rollout_logp.to(real), rows.zero)
    if options.rollout_is_cap is None:
        return RolloutCorrection(gap, None, None)
    log_weight = gap.clamp(max=math.log(options.rollout_is_cap))
    return RolloutCorrection(gap, log_weight, torch.exp(log_weight))


def vespo_weight(token_log_ratio, rollout: RolloutCorrection | None, advantages, rows: TokenRows,
                 options: LossOptions, real):
    """VESPO's phi_s [S] (detached): w_s = the product over the sample's response rows of ratio_t (token level
    whatever ratio_level) and of rho_t, each token's log clamped, then log w_s clamped to [log 1e-8, 20]."""
    clamp = VESPO_LOG_RATIO_CLAMP
    log_weight = rows.per_sample_sum(token_log_ratio.detach().clamp(-clamp, clamp), rows.is_response)
    if rollout is not None and rollout.log_weight is not None:  # TRL folds rho_t into w_s (it does not weight pg_t)
        log_weight = log_weight + rows.per_sample_sum(rollout.log_weight.clamp(VESPO_LOG_WEIGHT_MIN, clamp),
                                                      rows.is_response)
    return vespo_gamma_weight(advantages.to(real), log_weight.clamp(VESPO_LOG_WEIGHT_MIN, clamp), options.vespo_k_pos,
                              options.vespo_lambda_pos, options.vespo_k_neg, options.vespo_lambda_neg)


def off_policy_mask(token_logp, old, rows: TokenRows, inputs: LossInputs, options: LossOptions, real):
    """[N] bool: DeepSeek-V3.2's off-policy sequence mask as TRL's: False on the rows of a sample with A_s < 0 whose
    mean over its response rows of (b_t - logp_t) exceeds off_policy_mask_threshold (b_t: rollout_logp, else
    old_logp, else the current log-prob)."""
    behaviour = old if inputs.rollout_logp is None else inputs.rollout_logp.to(real)
    drift = rows.response_sample_mean(behaviour - token_logp.detach())
    return ((inputs.advantages.to(real) >= 0) | (drift <= options.off_policy_mask_threshold))[rows.sample]


class PolicyTerm(NamedTuple):
    """API.md's per-token policy term, [N] unless said. ratio: ratio_t; pg: pg_t after its weights (w_s,
    token_weight_t, rho_t) and masks; clip_taken [N] bool: a clip or truncation changed pg_t (response rows or not);
    policy_kl: the Policy-KL as it enters term_t (None without ref_logp); rollout: the truncated importance sampling
    (None without rollout_logp); off_policy_kept [N] bool (None without the mask); entropy_kept [N] bool: the
    response rows keeping pg_t and the entropy bonus (all of them without the entropy filter), kept_rows: 0-dim int64,
    their number; vespo_phi [S] (None unless vespo)."""

    ratio: torch.Tensor
    pg: torch.Tensor
    clip_taken: torch.Tensor
    policy_kl: torch.Tensor | None
    rollout: RolloutCorrection | None
    off_policy_kept: torch.Tensor | None
    entropy_kept: torch.Tensor
    kept_rows: torch.Tensor
    vespo_phi: torch.Tensor | None


def policy_term(token_logp, entropy, rows: TokenRows, inputs: LossInputs, options: LossOptions) -> PolicyTerm:
    """The policy term on response rows, in fp32 (fp64 for fp64 log-probs: the float64 tests): ratio_t, pg_t of
    `options.pg_objective`, times w_s, token_weight_t and rho_t (not with vespo), times TRL's off-policy mask and
    entropy filter (0/1, detached), and the Policy-KL."""
    real = torch.float64 if token_logp.dtype == torch.float64 else torch.float32
    advantage = inputs.advantages.to(real)[rows.sample]
    old = token_logp.detach() if inputs.old_logp is None else inputs.old_logp.to(real)  # None: on-policy
    token_log_ratio, ratio = policy_ratio(token_logp, old, rows, options)
    rollout = None if inputs.rollout_logp is None else rollout_correction(old, inputs.rollout_logp, rows, options,
                                                                          real)
    vespo_phi = None
    if options.pg_objective == "ppo-clip":
        pg, clip_taken = clipped_surrogate(advantage, ratio, options.clip_low, options.clip_high, options.dual_clip)
    elif options.pg_objective == "cispo":
        pg, clip_taken = cispo_term(advantage, ratio, token_logp, options.cispo_clip_max)
    elif options.pg_objective == "sapo":
        pg, clip_taken = sapo_term(advantage, ratio, options.sapo_temperature_pos, options.sapo_temperature_neg)
    else:  # vespo: pg_t = -phi(w_s) * A_s * logp_t
        vespo_phi = vespo_weight(token_log_ratio, rollout, inputs.advantages, rows, options, real)
        pg, clip_taken = -vespo_phi[rows.sample] * advantage * token_logp, torch.zeros_like(rows.is_response)

    if inputs.query_weight is not None:
        pg = inputs.query_weight.to(real)[rows.sample] * pg
    if inputs.token_weight is not None:
        pg = inputs.token_weight.to(real) * pg
    if rollout is not None and rollout.weight is not None and options.pg_objective != "vespo":
        pg = rollout.weight * pg

    off_policy_kept = None
    if options.off_policy_mask_threshold is not None:
        off_policy_kept = off_policy_mask(token_logp, old, rows, inputs, options, real)
        pg = off_policy_kept * pg
    entropy_kept, kept_rows = rows.is_response, rows.num_response
    if options.top_entropy_quantile < 1.0:
        entropy_kept = high_entropy_mask(entropy, rows.is_response, options.top_entropy_quantile,
                                         options.top_entropy_gather)
        kept_rows = entropy_kept.sum()
        pg = entropy_kept * pg

    policy_kl = None
    if inputs.ref_logp is not None:
        policy_kl = reference_k3(token_logp, inputs.ref_logp, rows, rows.is_response, options)
        if options.policy_kl_bias_correction:  # TRL's use_bias_correction_kl: times the ratio, not detached
            policy_kl = ratio * policy_kl
    return PolicyTerm(ratio=ratio, pg=pg, clip_taken=clip_taken, policy_kl=policy_kl, rollout=rollout,
                      off_policy_kept=off_policy_kept, entropy_kept=entropy_kept, kept_rows=kept_rows,
                      vespo_phi=vespo_phi)


def aggregation(rows: TokenRows, options: LossOptions) -> Callable[[torch.Tensor], torch.Tensor]:
    """aggregate(values [N]) -> 0-dim, `loss_agg` over response rows: "token-mean": their sum / num_items (None: the
    number of response rows); "seq-mean-token-mean" / "seq-mean-token-sum": each sample's mean / sum over its
    response rows, summed over samples with response rows / num_seqs (None: their number)."""
    if options.loss_agg == "token-mean":
        num_items = rows.num_response if options.num_items is None else options.num_items

        def token_mean(values):
            return _safe_div(torch.where(rows.is_response, values, rows.zero).sum(), num_items)
        return token_mean
    num_seqs = rows.has_response.sum() if options.num_seqs is None else options.num_seqs

    def sequence_mean(values):
        if options.loss_agg == "seq-mean-token-mean":
            per_sample = rows.response_sample_mean(values)
        else:
            per_sample = rows.per_sample_sum(values, rows.is_response)
        return _safe_div(torch.where(rows.has_response, per_sample, rows.zero).sum(), num_seqs)
    return sequence_mean


def query_kl(token_logp, query_logp, rows: TokenRows, inputs: LossInputs, options: LossOptions):
    """0-dim: the Query-KL, sum over samples with query rows of qkl_s / num_seqs (None: their number), or None without
    the reference its estimator needs. qkl_s = f(ref_query_logp_s - ell_theta(q_s)): a whole prompt's log-ratio, not
    clamped (a clamp zeroes the gradient once the prompt drifts that far) but its estimator continued linearly beyond
    qkl_linear_beyond (`linear_beyond`); "k3-token": the mean over the sample's query rows of the per-token k3."""
    if options.qkl_estimator == "k3-token":
        if inputs.ref_logp is None:
            return None
        per_token = reference_k3(token_logp, inputs.ref_logp, rows, rows.is_query, options)
        qkl_per_sample = rows.per_sample_sum(per_token, rows.is_query) / rows.query_rows.clamp_min(1)
    elif inputs.ref_query_logp is None:
        return None
    else:
        qkl_per_sample = clamped_kl(linear_beyond(inputs.ref_query_logp.float() - query_logp, options.qkl_estimator,
                                                  options.qkl_linear_beyond), options.kl_clamp)
    num_query_seqs = rows.num_query_samples if options.num_seqs is None else options.num_seqs
    return _safe_div(torch.where(rows.has_query, qkl_per_sample, rows.zero).sum(), num_query_seqs)


@torch.no_grad()
def loss_metrics(rows: TokenRows, policy: PolicyTerm, aggregate, inputs: LossInputs, options: LossOptions, *, qkl,
                 query_logp, entropy, kept_entropy, nonfinite) -> LossMetrics:
    """The metrics (`LossMetrics`, those that apply to the call) from the stages' results: qkl 0-dim or None,
    query_logp [S], entropy [N], kept_entropy [N] (H_t on the rows the entropy filter keeps, 0 elsewhere),
    nonfinite [N] bool."""
    rollout, phi = policy.rollout, policy.vespo_phi
    values = dict(
        entropy=rows.response_mean(entropy.detach()),
        clip_frac=rows.response_mean((rows.is_response & policy.clip_taken).float()),
        pg_loss=aggregate(policy.pg.detach()),
        ratio_mean=rows.response_mean(policy.ratio.detach()),
        query_logp_mean=(query_logp.detach() * rows.has_query).sum() / rows.num_query_samples.clamp_min(1),
        response_tokens=rows.num_response,
        nonfinite_rows=nonfinite.sum(),
        kept_tokens=policy.kept_rows,
        kept_entropy=kept_entropy.detach().sum() / policy.kept_rows.clamp_min(1),
    )
    if qkl is not None:
        values["qkl"] = qkl.detach()
    if policy.policy_kl is not None:
        values["policy_kl"] = rows.response_mean(policy.policy_kl.detach())
    if rollout is not None:
        values["rollout_logp_gap_abs"] = rows.response_mean(rollout.gap.abs())
        values["rollout_logp_gap_max"] = rows.response_max(rollout.gap.abs())
        if rollout.weight is not None:
            values["rollout_is_weight"] = rows.response_mean(rollout.weight)
    if policy.off_policy_kept is not None:
        values["off_policy_masked_frac"] = rows.response_mean((~policy.off_policy_kept).float())
    if phi is not None:
        values["vespo_phi_mean"] = (phi * rows.has_response).sum() / rows.has_response.sum().clamp_min(1)
    return LossMetrics.for_call(values, inputs, options)


def erpo_objective(token_logp, entropy, token_kind, sample_index, *, inputs: LossInputs, options: LossOptions,
                   segment_sum=SegmentSum) -> LossOutput:
    """ERPO loss from token_logp [N] fp32 and entropy [N] fp32 (both may require grad).

    token_kind [N] (0 not scored, 1 query, 2 response), sample_index [N] in [0, S) on scored rows; `inputs`
    (validated): advantages [S], ref_query_logp [S] or None, query_weight [S] or None (= 1), old_logp [N] or None
    (= on-policy), ref_logp [N] or None, token_weight [N] or None (= 1; multiplies pg_t like w_s), rollout_logp
    [N] or None (the rollout engine's sampling log-probs: pg_t is then also multiplied by the truncated
    importance-sampling weight min(exp(old_logp_t - rollout_logp_t), rollout_is_cap)).
    `segment_sum(sample_index, num_samples)` builds the per-sample sums (`SegmentSum`'s interface). The loss is
    differentiated with respect to token_logp and entropy alone: `inputs` are constants (`LossInputs.detached`).
    """
    inputs = inputs.detached()
    rows = TokenRows(token_kind, sample_index, inputs.advantages.shape[0], segment_sum)
    query_logp = rows.per_sample_sum(token_logp, rows.is_query)  # ell_theta(q)
    response_logp = rows.per_sample_sum(token_logp, rows.is_response)
    policy = policy_term(token_logp, entropy, rows, inputs, options)

    # term_t = pg_t + policy_kl_coef * KL_t - entropy_coef * H_t (the bonus on the rows the entropy filter keeps)
    kept_entropy = torch.where(policy.entropy_kept, entropy, rows.zero)
    term = policy.pg
    if options.policy_kl_coef != 0:
        term = term + options.policy_kl_coef * policy.policy_kl
    if options.entropy_coef != 0 and options.entropy_agg == "loss-agg":
        term = term - options.entropy_coef * kept_entropy
    aggregate = aggregation(rows, options)
    pg_part = aggregate(term)
    if options.entropy_coef != 0 and options.entropy_agg == "token-mean":  # TRL's entropy bonus, whatever loss_agg:
        # the mean of H_t over the rows the entropy filter keeps
        pg_part = pg_part - options.entropy_coef * kept_entropy.sum() / policy.kept_rows.clamp_min(1)

    qkl = query_kl(token_logp, query_logp, rows, inputs, options)
    loss = pg_part
    if options.qkl_coef != 0:
        loss = loss + options.qkl_coef * qkl
    # A non-finite scored row makes the loss NaN (and is counted in metrics), even when no term reads it.
    with torch.no_grad():
        nonfinite = (token_kind != 0) & ~(torch.isfinite(token_logp) & torch.isfinite(entropy))
    loss = loss + torch.where(nonfinite.any(), rows.nan, rows.zero)

    metrics = loss_metrics(rows, policy, aggregate, inputs, options, qkl=qkl, query_logp=query_logp,
                           entropy=entropy, kept_entropy=kept_entropy, nonfinite=nonfinite)
    return LossOutput(loss=loss, token_logp=token_logp.detach(), query_logp=query_logp.detach(),
                      response_logp=response_logp.detach(), entropy=entropy.detach(), metrics=metrics)
