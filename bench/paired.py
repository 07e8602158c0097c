"""Paired comparison of two algorithms over seeds, without scipy: the per-seed differences' mean and standard error,
the exact sign-flip test and the paired t-test.

Both tests read the per-seed differences d_1..d_n (algorithm A minus algorithm B trained on the same seed: the same
prompts and rollout seeds, so what a seed does to both cancels) and test "no difference":
- sign-flip (permutation) test: if A and B do not differ, each d_i is as likely to be -d_i; the two-sided p-value is
  the fraction of the 2^n sign assignments whose |sum| is at least the observed |sum|. Exact, and assumes no
  normality, but coarse: its smallest value is 2 / 2^n, so 5 seeds can never give less than 0.0625 and 6 are needed
  for p < 0.05.
- paired t-test: t = mean / (sd / sqrt(n)) with n - 1 degrees of freedom (assumes the differences are normal); the
  two-sided p-value is Student's t tail in closed form for integer degrees of freedom (`student_t_two_sided_p`).
"""
from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

MAX_SIGN_FLIP_SEEDS = 20   # 2^20 sign assignments: about a second; more seeds would need sampling instead


@dataclass(frozen=True)
class PairedSummary:
    """Per-seed differences A - B summarized: their count, mean, standard error (None for one seed), how many are
    positive, the sign-flip p-value, the t statistic and its p-value (None for one seed or differences all equal)."""
    n: int
    mean: float
    standard_error: float | None
    positive: int
    sign_flip_p: float
    t: float | None
    t_p: float | None


def sign_flip_p(differences: list[float]) -> float:
    """Two-sided exact sign-flip p-value of the per-seed differences (a list of n floats, 1 <= n <= 20): the fraction
    of the 2^n sign assignments whose |sum| reaches the observed |sum|."""
    n = len(differences)
    if not 1 <= n <= MAX_SIGN_FLIP_SEEDS:
        raise ValueError(f"sign_flip_p: {n} differences; give 1 to {MAX_SIGN_FLIP_SEEDS} (one per seed)")
    observed = abs(sum(differences))
    tolerance = 1e-12 * max(1.0, sum(abs(d) for d in differences))   # the same |sum| in another order of addition
    magnitudes = [abs(d) for d in differences]
    reached = sum(abs(sum(s * m for s, m in zip(signs, magnitudes))) >= observed - tolerance
                  for signs in itertools.product((1.0, -1.0), repeat=n))
    return reached / 2 ** n


def student_t_two_sided_p(t: float, dof: int) -> float:
    """P(|T| >= |t|) for Student's t with `dof` (a positive integer) degrees of freedom.

    Abramowitz & Stegun 26.7.3-4 give A(t|v) = P(|T| < t) with theta = arctan(|t| / sqrt(v)):
      v odd:  A = 2/pi * (theta + sin(theta) * (cos(theta) + 2/3 cos^3(theta) + ... + (2*4*..*(v-3)) / (1*3*..*(v-2))
              cos^(v-2)(theta))), the bracket empty for v = 1;
      v even: A = sin(theta) * (1 + 1/2 cos^2(theta) + ... + (1*3*..*(v-3)) / (2*4*..*(v-2)) cos^(v-2)(theta)).
    Each term is the one before times (k-1)/k * cos^2(theta), k running over the odd (v odd) or even (v even) numbers
    from 3 (or 2) to v - 2."""
    if dof < 1 or int(dof) != dof:
        raise ValueError(f"student_t_two_sided_p: dof {dof!r}; give a positive integer (seeds - 1)")
    theta = math.atan(abs(t) / math.sqrt(dof))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    term = total = math.cos(theta) if dof % 2 else 1.0
    for k in range(3 if dof % 2 else 2, dof - 1, 2):
        term *= (k - 1) / k * cos2
        total += term
    inside = 2 / math.pi * (theta + (sin * total if dof > 1 else 0.0)) if dof % 2 else sin * total
    return max(0.0, 1.0 - inside)


def paired_summary(differences: list[float]) -> PairedSummary:
    """Summary of the per-seed differences A - B (a list of 1 to 20 floats, one per seed)."""
    n = len(differences)
    p_flip = sign_flip_p(differences)   # checks n
    mean = statistics.fmean(differences)
    se = statistics.stdev(differences) / math.sqrt(n) if n > 1 else None
    t = mean / se if se else None       # no t for one seed, nor when every seed differs by the same amount
    return PairedSummary(n=n, mean=mean, standard_error=se, positive=sum(d > 0 for d in differences),
                         sign_flip_p=p_flip, t=t, t_p=None if t is None else student_t_two_sided_p(t, n - 1))
