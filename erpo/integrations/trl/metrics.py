"""ERPOTrainer's logged loss metrics: TRL's own (same names and reductions over processes), then ERPO's (qkl,
query_logp, query_weight_mean). A metric that does not apply to the call is left out, as TRL leaves out its own (no
`kl` without a reference model). A mixin of ERPOTrainer (it writes the trainer's `_metrics`)."""
from __future__ import annotations

import torch

from erpo.integrations.trl.layout import CompletionRows
from erpo.integrations.trl.loss import BATCH_NORMALIZED, PG_OBJECTIVES


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of [B, T] (or per-sequence [B, 1]) values over mask [B, T], as (sum, count) for a global reduction."""
    if values.shape[1] == 1:
        return torch.stack([values.sum(), torch.tensor(float(values.shape[0]), device=values.device)])
    return torch.stack([(values * mask).sum(), mask.sum()])


class LossMetricsMixin:
    """`_log_loss_metrics(...)` of ERPOTrainer, called once per micro-batch by `_compute_loss`."""

    def _log_loss_metrics(self, mode: str, inputs: dict, rows: CompletionRows, out, query_weight, options,
                          aux_loss) -> None:
        metrics = self._metrics[mode]
        mask = rows.layout.response_mask
        logp = rows.loss_rows.gather(out.token_logp)
        old = inputs.get("old_per_token_logps")
        log_ratio = logp - (logp if old is None else old)
        if self.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        ratio = torch.exp(log_ratio)
        advantages = inputs["advantages"].unsqueeze(1)

        def global_mean(values):
            total = self.accelerator.reduce(masked_mean(values, mask), reduction="sum")
            return (total[0] / total[1].clamp(min=1.0)).item()

        qkl_part = options["qkl_coef"] * out.metrics["qkl"] if options["qkl_coef"] != 0 else 0.0
        if self._entropy_bonus_enabled:  # TRL's loss before the bonus (a mean over the rows the entropy filter
            # keeps), on TRL's scale: per micro-batch, except for the types normalized by the generation batch
            policy_loss = out.loss.detach() + options["entropy_coef"] * out.metrics["kept_entropy"] - qkl_part
            if mode == "train" and self.loss_type not in BATCH_NORMALIZED:
                policy_loss = policy_loss * self.current_gradient_accumulation_steps
            metrics["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        if aux_loss is not None:
            metrics["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item())
        if self.beta != 0:
            ref = inputs["ref_per_token_logps"]
            kl = torch.expm1(ref - logp) - (ref - logp)
            metrics["kl"].append(global_mean(kl * ratio if self.args.use_bias_correction_kl else kl))
        metrics["entropy"].append(global_mean(rows.loss_rows.gather(out.entropy)))
        if PG_OBJECTIVES[self.loss_type] == "ppo-clip":
            self._log_clip_ratios(metrics, mask, ratio, advantages, global_mean)
        elif self.loss_type == "cispo":   # truncated weights of positive advantages only (our clip_frac counts all)
            metrics["cispo_clip_ratio"].append(global_mean(((ratio > self.epsilon_high) & (advantages > 0)).float()))
        elif self.loss_type == "vespo":   # a mean over all B samples, phi = 1 for one without scored tokens (w = 1)
            num, scored = mask.shape[0], (mask.sum(-1) > 0).sum()
            phi_sum = out.metrics["vespo_phi_mean"].float() * scored + (num - scored)
            total = self.accelerator.reduce(torch.stack([phi_sum, phi_sum.new_tensor(float(num))]), reduction="sum")
            metrics["vespo/phi_seq_mean"].append((total[0] / total[1].clamp(min=1.0)).item())

        num = inputs["prompt_ids"].shape[0]
        if "qkl" in out.metrics:  # absent without ref_query_logp; the loss's qkl is a sum over samples / num_seqs
            metrics["qkl"].append(self.accelerator.gather(out.metrics["qkl"] * options["num_seqs"] / num).mean().item())
        metrics["query_logp"].append(self.accelerator.gather(out.query_logp.mean()).mean().item())
        if query_weight is not None:
            metrics["query_weight_mean"].append(self.accelerator.gather(query_weight.float().mean()).mean().item())

    def _log_clip_ratios(self, metrics, mask, ratio, advantages, global_mean) -> None:
        """TRL's clip_ratio/* of the clipped-surrogate loss types."""
        low = ((ratio < 1 - self.epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (advantages > 0)).float()
        metrics["clip_ratio/low_mean"].append(global_mean(low))
        metrics["clip_ratio/high_mean"].append(global_mean(high))
        metrics["clip_ratio/region_mean"].append(global_mean(torch.maximum(low, high)))

        def per_sequence(values):  # NaN for sequences without scored tokens, as TRL
            return values.squeeze(1) if values.shape[1] == 1 else (values * mask).sum(-1) / mask.sum(-1)

        for name, values, reduce in (("low_min", low, torch.min), ("high_max", high, torch.max)):
            gathered = self.accelerator.gather(per_sequence(values))
            gathered = gathered[~gathered.isnan()]
            metrics[f"clip_ratio/{name}"].append(reduce(gathered).item() if gathered.numel() else float("nan"))
