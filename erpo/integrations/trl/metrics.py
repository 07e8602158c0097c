"""ERPOTrainer's logged loss metrics: TRL's own (same names and reductions over processes), then ERPO's (qkl,
query_logp, query_weight_mean). A metric that does not apply to the call is left out, as TRL leaves out its own (no
`kl` without a reference model). Each is reduced over the processes on the device, and a micro-batch's metrics
are read on the host in one copy (TRL reads each with its own `.item()`). A mixin of ERPOTrainer (it writes the
trainer's `_metrics`)."""
from __future__ import annotations

import torch

from erpo.integrations.trl.layout import CompletionRows
from erpo.integrations.trl.loss import BATCH_NORMALIZED, PG_OBJECTIVES


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of [B, T] (or per-sequence [B, 1]) values over mask [B, T], as (sum, count) for a global reduction."""
    if values.shape[1] == 1:
        return torch.stack([values.sum(), torch.full((), float(values.shape[0]), device=values.device)])  # no upload
    return torch.stack([(values * mask).sum(), mask.sum()])


class LossMetricsMixin:
    """`_log_loss_metrics(...)` of ERPOTrainer, called once per micro-batch by `_compute_loss`."""

    def _log_loss_metrics(self, mode: str, inputs: dict, rows: CompletionRows, out, query_weight, options,
                          aux_loss) -> None:
        """Append this micro-batch's metrics to `_metrics[mode]`: one host read for all of them."""
        metrics = self._metrics[mode]
        values = {}   # name -> 0-dim device tensor, read below
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
            return total[0] / total[1].clamp(min=1.0)

        qkl_part = options["qkl_coef"] * out.metrics["qkl"] if options["qkl_coef"] != 0 else 0.0
        if self._entropy_bonus_enabled:  # TRL's loss before the bonus (a mean over the rows the entropy filter
            # keeps), on TRL's scale: per micro-batch, except for the types normalized by the generation batch
            policy_loss = out.loss.detach() + options["entropy_coef"] * out.metrics["kept_entropy"] - qkl_part
            if mode == "train" and self.loss_type not in BATCH_NORMALIZED:
                policy_loss = policy_loss * self.current_gradient_accumulation_steps
            values["policy_loss"] = self.accelerator.gather(policy_loss).nanmean()
            if mode == "train" and self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        if aux_loss is not None:
            values["aux_loss"] = self.accelerator.gather_for_metrics(aux_loss.detach()).mean()
        if self.beta != 0:
            ref = inputs["ref_per_token_logps"]
            kl = torch.expm1(ref - logp) - (ref - logp)
            values["kl"] = global_mean(kl * ratio if self.args.use_bias_correction_kl else kl)
        values["entropy"] = global_mean(rows.loss_rows.gather(out.entropy))
        if PG_OBJECTIVES[self.loss_type] == "ppo-clip":
            values.update(self._clip_ratios(mask, ratio, advantages, global_mean))
        elif self.loss_type == "cispo":   # truncated weights of positive advantages only (our clip_frac counts all)
            values["cispo_clip_ratio"] = global_mean(((ratio > self.epsilon_high) & (advantages > 0)).float())
        elif self.loss_type == "vespo":   # a mean over all B samples, phi = 1 for one without scored tokens (w = 1)
            num, scored = mask.shape[0], (mask.sum(-1) > 0).sum()
            phi_sum = out.metrics["vespo_phi_mean"].float() * scored + (num - scored)
            total = self.accelerator.reduce(torch.stack([phi_sum, phi_sum.new_full((), float(num))]), reduction="sum")
            values["vespo/phi_seq_mean"] = total[0] / total[1].clamp(min=1.0)

        num = inputs["prompt_ids"].shape[0]
        if "qkl" in out.metrics:  # absent without ref_query_logp; the loss's qkl is a sum over samples / num_seqs
            values["qkl"] = self.accelerator.gather(out.metrics["qkl"] * options["num_seqs"] / num).mean()
        values["query_logp"] = self.accelerator.gather(out.query_logp.mean()).mean()
        if query_weight is not None:
            values["query_weight_mean"] = self.accelerator.gather(query_weight.float().mean()).mean()
        read = torch.stack([value.double() for value in values.values()]).tolist()   # the one host read
        for name, number in zip(values, read):
            metrics[name].append(number)

    def _clip_ratios(self, mask, ratio, advantages, global_mean) -> dict[str, torch.Tensor]:
        """TRL's clip_ratio/* of the clipped-surrogate loss types, as 0-dim device tensors."""
        low = ((ratio < 1 - self.epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (advantages > 0)).float()
        values = {"clip_ratio/low_mean": global_mean(low), "clip_ratio/high_mean": global_mean(high),
                  "clip_ratio/region_mean": global_mean(torch.maximum(low, high))}

        def per_sequence(values):  # NaN for sequences without scored tokens, as TRL
            return values.squeeze(1) if values.shape[1] == 1 else (values * mask).sum(-1) / mask.sum(-1)

        for name, fractions, reduce, neutral in (("low_min", low, torch.min, float("inf")),
                                                 ("high_max", high, torch.max, -float("inf"))):
            gathered = self.accelerator.gather(per_sequence(fractions))
            unscored = gathered.isnan()   # TRL drops them (a boolean index, a host read): here the neutral value
            extreme = reduce(torch.where(unscored, neutral, gathered))
            values[f"clip_ratio/{name}"] = torch.where(unscored.all(), float("nan"), extreme)   # NaN: none scored
        return values
