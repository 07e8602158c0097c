"""TRL's loss settings mapped onto erpo_kernels' options (loss type, normalizers over gradient accumulation,
processes and steps_per_generation, clipping, KL, the off-policy mask, the entropy filter and bonus, vLLM's
importance sampling), and the current policy's w(q) over all processes.

`trl_loss_options` is the one copy of the GRPOConfig -> erpo_kernels mapping: ERPOTrainer calls it,
and tests/integrations/test_pg_objectives.py calls it on a stand-in GRPOTrainer to compare with TRL's own
`_compute_loss`."""
from __future__ import annotations

import functools

import torch

from erpo.integrations.trl.layout import CompletionRows
from erpo_kernels import VESPO_LAMBDA_MIN, query_weights

# TRL 1.16's loss types -> the kernels' policy term; luspo is the clipped surrogate with its own aggregation
PG_OBJECTIVES = {"grpo": "ppo-clip", "bnpo": "ppo-clip", "dr_grpo": "ppo-clip", "dapo": "ppo-clip",
                 "luspo": "ppo-clip", "cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}
BATCH_NORMALIZED = ("dapo", "cispo", "vespo")   # divided by num_items_in_batch (TRL's whole generation batch)
ENTROPY_PAD = -1e9   # TRL's padding of the entropies gathered across processes (an entropy is never negative)


def gather_entropies(accelerator, local: torch.Tensor) -> torch.Tensor:
    """Every process's entropies [m] from this process's [n]: TRL's get_high_entropy_mask pool (padded to one
    length with ENTROPY_PAD, gathered, the padding dropped)."""
    gathered = accelerator.gather(accelerator.pad_across_processes(local, dim=0, pad_index=ENTROPY_PAD))
    return gathered[gathered != ENTROPY_PAD]


def applied_entropy_coef(trainer) -> float:
    """The entropy bonus's coefficient this micro-batch, as GRPOTrainer applies it: with use_adaptive_entropy, the
    current coefficient only while the last optimizer step's entropy was <= entropy_target (else 0)."""
    if trainer.use_adaptive_entropy and not trainer._last_world_entropy <= trainer.args.entropy_target:
        return 0.0
    return trainer.entropy_coef


def trl_loss_options(trainer, inputs: dict, mode: str) -> tuple[dict, dict]:
    """(erpo_kernels options, completion-aligned tensors [B, T] or [B, 1] or None) reproducing
    `GRPOTrainer._compute_loss` on one micro-batch of `inputs` in `mode` ("train" | "eval").

    `trainer` is a GRPOTrainer (or a stand-in with its attributes): its args, loss settings, adaptive-entropy state
    and accelerator. The tensors are old_logp, ref_logp, token_weight (vLLM's importance_sampling_ratio) and
    rollout_logp (vLLM's sampling log-probs, for the off-policy mask and VESPO's rollout correction; a NaN, a token
    vLLM could not score, is replaced by the old log-prob: TRL's ratio of 1 there, and its zero drift in the
    off-policy mask on a generation's first iteration. Without old log-probs it stays NaN, for the caller to
    replace by the current log-prob)."""
    args = trainer.args
    num = inputs["advantages"].shape[0]
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1
    objective = PG_OBJECTIVES[trainer.loss_type]
    options = dict(
        pg_objective=objective, policy_kl_coef=trainer.beta, policy_kl_bias_correction=args.use_bias_correction_kl,
        clip_low=trainer.epsilon_low, clip_high=trainer.epsilon_high,
        dual_clip=args.delta if objective == "ppo-clip" else None,   # TRL's delta acts on the clipped surrogate only
        ratio_level=trainer.importance_sampling_level, cispo_clip_max=trainer.epsilon_high,
        sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
        vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=max(args.vespo_lambda_pos, VESPO_LAMBDA_MIN),   # TRL's clamp
        vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=max(args.vespo_lambda_neg, VESPO_LAMBDA_MIN),
        off_policy_mask_threshold=trainer.off_policy_mask_threshold,
        top_entropy_quantile=trainer.top_entropy_quantile,
        # the quantile over every process's entropies; in one process over this call's rows, with no gather (whose
        # padding, sizes and boolean selection cost three host syncs)
        top_entropy_gather=functools.partial(gather_entropies, trainer.accelerator)
        if trainer.top_entropy_quantile < 1.0 and trainer.accelerator.num_processes > 1 else None,
        # TRL's entropy bonus: a token mean over the kept tokens of the micro-batch, divided by the accumulation steps
        entropy_coef=applied_entropy_coef(trainer) / accumulation, entropy_agg="token-mean", rollout_is_cap=None,
        num_seqs=num * accumulation)   # per-sample means (grpo, sapo, luspo; the Query-KL) over the optimizer step
    mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
    if trainer.loss_type in ("grpo", "sapo", "luspo"):
        options["loss_agg"] = "seq-mean-token-sum" if trainer.loss_type == "luspo" else "seq-mean-token-mean"
    elif trainer.loss_type == "bnpo":
        options.update(loss_agg="token-mean", num_items=mask.float().sum().clamp(min=1.0) * accumulation)
    elif trainer.loss_type == "dr_grpo":
        options.update(loss_agg="token-mean", num_items=num * trainer.max_completion_length * accumulation)
    else:  # BATCH_NORMALIZED: num_items_in_batch spans the generation batch over all processes
        num_items = inputs["num_items_in_batch"].float().clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            num_items = num_items * accumulation / args.steps_per_generation
        options.update(loss_agg="token-mean", num_items=num_items)

    old = inputs.get("old_per_token_logps")
    importance_sampling = trainer.use_vllm and trainer.vllm_importance_sampling_correction
    tensors = dict(old_logp=old, ref_logp=inputs["ref_per_token_logps"] if trainer.beta != 0 else None,
                   token_weight=inputs["importance_sampling_ratio"]
                   if importance_sampling and trainer.loss_type != "vespo" else None, rollout_logp=None)
    sampling = inputs.get("sampling_per_token_logps")
    vespo_correction = importance_sampling and trainer.loss_type == "vespo"
    if sampling is not None and (vespo_correction or trainer.off_policy_mask_threshold is not None):
        # the behaviour policy of the off-policy mask; VESPO folds min(exp(old - sampling), clip_max) into w_s
        tensors["rollout_logp"] = sampling if old is None else torch.where(sampling.isnan(), old, sampling)
        if vespo_correction:
            options["rollout_is_cap"] = args.vllm_importance_sampling_clip_max
    return options, tensors


class LossOptionsMixin:
    """`_loss_options(inputs, rows, mode)` and `_current_query_weights(query_logp)` of ERPOTrainer."""

    # The state it shares with ERPOTrainer, which sets it at construction (`_check_model`)
    _logit_options: dict   # the model's final-logit transform as loss options (fused-linear path; {} on logits)

    def _loss_options(self, inputs: dict, rows: CompletionRows, mode: str) -> tuple[dict, dict]:
        """erpo_kernels options reproducing TRL's loss on one micro-batch, plus ERPO's Query-KL, and the loss's
        per-row tensors from TRL's (old and reference log-probs, vLLM's importance sampling), on `rows`."""
        options, tensors = trl_loss_options(self, inputs, mode)
        options.update(qkl_coef=self.args.qkl_coef, qkl_estimator=self.args.qkl_estimator,
                       temperature=self.temperature,
                       **self._logit_options)  # the model's logit transform on the fused-linear path (ERPOTrainer)
        return options, {name: None if value is None else rows.loss_rows.scatter(value, name)
                         for name, value in tensors.items()}

    def _current_query_weights(self, query_logp: torch.Tensor) -> torch.Tensor:
        """w(q) [B] from the current policy's ell_theta(q) [B] over this micro-batch's prompts on all processes."""
        everyone = self.accelerator.gather(query_logp.double())
        weights = query_weights(everyone)
        start = self.accelerator.process_index * query_logp.shape[0]
        return weights[start:start + query_logp.shape[0]].to(query_logp.device)
