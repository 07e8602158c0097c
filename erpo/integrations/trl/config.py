"""`ERPOConfig`: TRL's GRPOConfig plus ERPO's options, each checked once when the config is built."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import GRPOConfig

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")   # the TRL loss types our loss expresses exactly
QUERY_WEIGHTS = ("static", "current", "none")
QKL_ESTIMATORS = ("k1", "k2", "k3")
CACHE_FILE = "erpo_reference_cache.json"


@dataclass
class ERPOConfig(GRPOConfig):
    """GRPOConfig plus ERPO's options (the loss's own defaults, docs/API.md)."""

    qkl_coef: float = field(default=0.01, metadata={"help": "alpha, weight of the Query-KL term"})
    qkl_estimator: str = field(default="k3", metadata={
        "help": "KL estimator on the sequence log-ratio ell_theta0(q) - ell_theta(q): k1, k2 or k3"})
    query_weight: str = field(default="static", metadata={
        "help": "w(q) on each query's policy-gradient term: static (from ell_theta0, cached), current (from the "
                "current policy over the micro-batch's prompts, all processes) or none"})
    ref_cache: str | None = field(default=None, metadata={
        "help": "ell_theta0(q) cache to read (written by this trainer or by `erpo precompute-ref`), or to write when "
                "absent; default <output_dir>/" + CACHE_FILE})
    fused_linear: bool = field(default=True, metadata={
        "help": "score hidden states x lm_head without the [N, V] logits (False: the model's own logits)"})

    def __post_init__(self):
        super().__post_init__()
        if self.query_weight not in QUERY_WEIGHTS:
            raise ValueError(f"query_weight must be one of {list(QUERY_WEIGHTS)}, got {self.query_weight!r}")
        if self.qkl_estimator not in QKL_ESTIMATORS:
            raise ValueError(f"qkl_estimator must be one of {list(QKL_ESTIMATORS)} with TRL, got "
                             f"{self.qkl_estimator!r} (k3-token needs reference log-probs of the prompt tokens, "
                             "which GRPOTrainer does not compute)")
        if not (isinstance(self.qkl_coef, (int, float)) and math.isfinite(self.qkl_coef)):
            raise ValueError(f"qkl_coef must be a finite number, got {self.qkl_coef!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not supported by ERPOTrainer; use one of "
                             f"{list(LOSS_TYPES)}")
        epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if self.delta is not None and self.delta <= 1 + epsilon_high:
            raise ValueError(f"delta must be > 1 + epsilon_high = {1 + epsilon_high} with ERPOTrainer (it is then "
                             f"the dual clip of negative advantages), got {self.delta}")
        unsupported = {"top_entropy_quantile": self.top_entropy_quantile < 1.0,
                       "off_policy_mask_threshold": self.off_policy_mask_threshold is not None,
                       "use_adaptive_entropy": self.use_adaptive_entropy}
        for name, is_set in unsupported.items():
            if is_set:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by ERPOTrainer; leave it at "
                                 "GRPOConfig's default")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads ell_theta0(q): for the Query-KL or for the static w(q)."""
        return self.qkl_coef != 0 or self.query_weight == "static"
