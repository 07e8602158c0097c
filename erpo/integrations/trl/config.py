"""`ERPOConfig`: TRL's GRPOConfig plus ERPO's options, each checked once when the config is built."""
from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from erpo.integrations.trl.loss import PG_OBJECTIVES
from erpo.reference.cache import CACHE_FILE
from erpo.terms import QUERY_WEIGHTS_TRL, SEQUENCE_QKL_ESTIMATORS, check_choice, check_qkl_coef, needs_reference


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
    iterable_prompts: int = field(default=10_000, metadata={
        "help": "rows of an IterableDataset (train or eval) read once at construction for their ell_theta0(q); a "
                "prompt beyond them is scored at theta0 from the first step's forward, and refused after it"})
    fused_linear: bool = field(default=True, metadata={
        "help": "score hidden states x lm_head without the [N, V] logits (False: the model's own logits)"})
    loss_workspace_mib: int = field(default=1024, metadata={
        "help": "fused_linear=True: the loss's workspace_bytes in MiB (default 1 GiB, the loss's own): more memory, "
                "fewer passes over the fp32 d weight accumulator, faster (docs/training.md)"})

    def __post_init__(self):
        super().__post_init__()
        check_choice("query_weight", self.query_weight, QUERY_WEIGHTS_TRL)
        check_choice("qkl_estimator", self.qkl_estimator, SEQUENCE_QKL_ESTIMATORS, hint=(
            " with TRL (k3-token needs reference log-probs of the prompt tokens, which GRPOTrainer does not "
            "compute)"))
        check_qkl_coef(self.qkl_coef)
        if not (isinstance(self.iterable_prompts, int) and self.iterable_prompts >= 1):
            raise ValueError(f"iterable_prompts must be an integer >= 1, got {self.iterable_prompts!r}")
        if isinstance(self.loss_workspace_mib, bool) or not (isinstance(self.loss_workspace_mib, int)
                                                             and self.loss_workspace_mib >= 1):
            raise ValueError(f"loss_workspace_mib must be an integer >= 1 (MiB), got {self.loss_workspace_mib!r}")
        if self.loss_type not in PG_OBJECTIVES:
            raise ValueError(f"loss_type={self.loss_type!r} is not supported by ERPOTrainer; use one of "
                             f"{list(PG_OBJECTIVES)}")
        epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if self.delta is not None and PG_OBJECTIVES[self.loss_type] == "ppo-clip" and self.delta <= 1 + epsilon_high:
            raise ValueError(f"delta must be > 1 + epsilon_high = {1 + epsilon_high} with ERPOTrainer (it is then "
                             f"the dual clip of negative advantages), got {self.delta}")
        if self.loss_type == "vespo" and self.use_vllm and self.vllm_importance_sampling_correction:
            self._check_vespo_rollout_correction()

    def _check_vespo_rollout_correction(self) -> None:
        """What of vLLM's importance sampling VESPO's sequence weight can fold in: the per-token truncation
        min(ratio, clip_max) with clip_max >= 1 (TRL also sums the log-ratios of masked positions, which are then 0)."""
        if self.vllm_importance_sampling_mode == "token_mask":
            raise ValueError("loss_type='vespo' with vllm_importance_sampling_mode='token_mask' is not supported by "
                             "ERPOTrainer (TRL turns masked ratios into log(1e-8) terms of the sequence weight, which "
                             "the loss cannot express); use 'token_truncate'")
        if self.vllm_importance_sampling_clip_min is not None:
            raise ValueError("loss_type='vespo' with vllm_importance_sampling_clip_min is not supported by "
                             "ERPOTrainer (the loss truncates the rollout ratio from above only); set it to None")
        if self.vllm_importance_sampling_clip_max is not None and self.vllm_importance_sampling_clip_max < 1:
            raise ValueError("loss_type='vespo' with vllm_importance_sampling_clip_max < 1 is not supported by "
                             "ERPOTrainer (TRL then also counts the cap on padding positions); use a value >= 1")

    @property
    def needs_reference(self) -> bool:
        """`erpo.terms.needs_reference` of this config."""
        return needs_reference(self.qkl_coef, self.query_weight)
