"""TRL's loss settings mapped onto erpo_kernels' options (loss type, normalizers over gradient accumulation,
processes and steps_per_generation, clipping, KL, entropy bonus), and the current policy's w(q) over all
processes. A mixin of ERPOTrainer (it reads the trainer's settings and accelerator)."""
from __future__ import annotations

import torch

from erpo.integrations.trl.layout import CompletionRows
from erpo_kernels import query_weights


class LossOptionsMixin:
    """`_loss_options(inputs, rows, mode)` and `_current_query_weights(query_logp)` of ERPOTrainer."""

    def _loss_options(self, inputs: dict, rows: CompletionRows, mode: str) -> dict:
        """erpo_kernels options reproducing TRL's loss for `self.loss_type` on one micro-batch (normalizers
        included: gradient accumulation, processes, steps_per_generation), plus ERPO's Query-KL."""
        num = inputs["prompt_ids"].shape[0]
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        options = dict(qkl_coef=self.args.qkl_coef, qkl_estimator=self.args.qkl_estimator, policy_kl_coef=self.beta,
                       policy_kl_bias_correction=self.args.use_bias_correction_kl, clip_low=self.epsilon_low,
                       clip_high=self.epsilon_high, dual_clip=self.args.delta,
                       ratio_level=self.importance_sampling_level, temperature=self.temperature,
                       # TRL's entropy bonus: a token mean over the micro-batch, divided by the accumulation steps
                       entropy_coef=self.entropy_coef / accumulation, entropy_agg="token-mean",
                       num_seqs=num * accumulation,  # per-sample means (grpo, the Query-KL) over the optimizer step
                       **self._logit_options)  # the model's logit transform on the fused-linear path (ERPOTrainer)
        if self.loss_type == "grpo":
            return dict(options, loss_agg="seq-mean-token-mean")
        if self.loss_type == "bnpo":
            num_items = rows.response_mask.sum().clamp(min=1.0) * accumulation
        elif self.loss_type == "dr_grpo":
            num_items = num * self.max_completion_length * accumulation
        else:  # dapo: num_items_in_batch spans the generation batch over all processes
            num_items = inputs["num_items_in_batch"].float().clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * accumulation / self.args.steps_per_generation
        return dict(options, loss_agg="token-mean", num_items=num_items)

    def _current_query_weights(self, query_logp: torch.Tensor) -> torch.Tensor:
        """w(q) [B] from the current policy's ell_theta(q) [B] over this micro-batch's prompts on all processes."""
        everyone = self.accelerator.gather(query_logp.double())
        weights = query_weights(everyone)
        start = self.accelerator.process_index * query_logp.shape[0]
        return weights[start:start + query_logp.shape[0]].to(query_logp.device)
