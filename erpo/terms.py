"""ERPO's two terms as every trainer exposes them (`erpo train`, ERPOTrainer, the verl loss), defined once: the
names of the query-weight modes and of the Query-KL estimators, when the loss reads the cached ell_theta0(q), and
the check of the Query-KL's coefficient."""
from __future__ import annotations

import math

from erpo_kernels import OPTION_CHOICES

# w(q) on each sample's policy term: static (cached, from ell_theta0), current (from the current policy, clipped to
# [0, MAX_QUERY_WEIGHT]), current-unclipped (the official code's per-step weight), none (w = 1). `erpo train` offers
# them all; ERPOTrainer QUERY_WEIGHTS_TRL, verl QUERY_WEIGHTS_VERL.
QUERY_WEIGHTS = ("static", "current", "current-unclipped", "none")
QUERY_WEIGHTS_TRL = ("static", "current", "none")
QUERY_WEIGHTS_VERL = ("static", "none")
# The Query-KL's estimators on the sequence log-ratio ell_theta0(q) - ell_theta(q), which need only the cache; the
# kernels' "k3-token" also needs reference log-probs of every prompt token (a live reference model: `erpo train`).
SEQUENCE_QKL_ESTIMATORS = tuple(name for name in OPTION_CHOICES["qkl_estimator"] if name != "k3-token")


def needs_reference(qkl_coef: float, query_weight: str) -> bool:
    """Whether the loss reads the cached ell_theta0(q): for the Query-KL, or for the static w(q)."""
    return qkl_coef != 0 or query_weight == "static"


def check_qkl_coef(value, name: str = "qkl_coef") -> None:
    """ValueError naming `name` unless `value` is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def check_choice(name: str, value, choices: tuple[str, ...], hint: str = "") -> None:
    """ValueError naming `name` and its choices unless `value` is one of them; `hint`: what to do, appended."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}{hint}")
