"""One optimizer step over a `StepPlan`: the fused-linear ERPO loss of every micro-batch, its backward, the
update (or a skip when a loss or gradient is not finite) and the step's metrics record.

Loss normalizers (`num_items`, `num_seqs`) are global, so each rank's loss is its share of the full-batch loss;
the backward multiplies it by the world size because DeepSpeed averages gradients over ranks.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

from erpo import distributed as D
from erpo.config import Config
from erpo.sequences import final_hidden, scored_token_logp
from erpo.train.metrics import SUMMED_METRICS, TOKEN_MEAN_METRICS, step_record
from erpo.train.step_plan import StepPlan
from erpo.train.train_state import TrainState
from erpo.train.updater import Updater
from erpo_kernels import fused_linear_erpo_loss
from erpo_kernels.layout import host_to_device
from erpo_kernels.lm_head import whole_lm_head

log = logging.getLogger("erpo")


def entropy_pool(weight: float):
    """The entropy filter's `top_entropy_gather` for one micro-batch of weight `weight`: this rank's response-row
    entropies [n] -> every rank's [m], so the top_entropy_quantile threshold is global over ranks, as TRL's (a
    stand-in, weight 0, adds none). A collective: every rank calls it once per micro-batch (stand-ins included). In
    one process the loss takes none: its quantile over the call's rows is the same, without selecting the pool from
    the rows (3 host reads per micro-batch)."""
    return lambda local: D.all_gather_cat(local if weight else local[:0])


def step_entropy_coef(options: dict, response_rows: int) -> float:
    """The entropy coefficient of a micro-batch of `response_rows` response tokens, such that the bonuses of the
    step's micro-batches on all ranks add up to the step's: with entropy_agg="token-mean" the loss takes the mean
    of H_t over the call's rows, so each micro-batch's mean is weighted by its share of the step's response tokens
    (options["num_items"], global) and the sum is entropy_coef x the step's token mean, however the step is split
    (summed unweighted, k micro-batches gave k times the bonus). "loss-agg" divides by num_items itself."""
    if options["entropy_agg"] != "token-mean":
        return options["entropy_coef"]
    return options["entropy_coef"] * response_rows / options["num_items"]


def accumulate_loss(cfg: Config, updater: Updater, ref_model, plan: StepPlan, old_logp: list[torch.Tensor] | None,
                    query_weight: list[torch.Tensor | None], ref_query_logp: torch.Tensor,
                    logit_options: dict) -> tuple[dict, float | None, int]:
    """Forward and backward of every micro-batch of `plan`; `logit_options`: the model's logit transform, read once
    at setup (`erpo.sequences.logit_transforms`). Returns (this rank's sums of the loss metrics over its real
    micro-batches: "loss" and SUMMED_METRICS, those of TOKEN_MEAN_METRICS weighted by tokens; the largest rollout
    log-prob gap; the number of non-finite losses seen). A metric that does not apply to the loss (`LossMetrics`:
    policy_kl without a reference model, the rollout ones without importance sampling) has no sum, and the gap is
    then None: the options and which inputs are given decide that, the same on every micro-batch and rank."""
    # num_items is 0 when every response of the step is masked (mask_truncated): no row then divides by it, and the
    # loss refuses 0, so it is clamped to 1 as TRL clamps its token count (the Query-KL still trains)
    options = {**dataclasses.asdict(cfg.algorithm.loss_options), **logit_options,
               "num_items": max(plan.num_items, 1), "num_seqs": plan.num_seqs}
    temperature = cfg.rollout.temperature
    # The sums stay on the device, in fp64 (as Python floats would hold them), and are read once per step: no host
    # read per micro-batch for the metrics, nor for the finiteness of the loss, which the backward's weight follows
    # on the device (0 from the first non-finite loss on: that step is discarded whatever its gradient holds).
    sums: dict = {"loss": 0.0}
    gap_max, nonfinite = None, 0
    rollout = plan.rollout
    for m, mb in enumerate(plan.micro_batches):
        batch, device = mb.batch, mb.batch.targets.device
        ref_logp = scored_token_logp(ref_model, batch, temperature, logit_options=logit_options) \
            if ref_model is not None else None
        hidden = final_hidden(updater.model, batch)
        with whole_lm_head(updater.model) as (weight, bias):
            out = fused_linear_erpo_loss(
                hidden.to(weight.dtype), weight, batch.targets, batch.token_kind, batch.sample_index, bias=bias,
                advantages=host_to_device(rollout.advantages[mb.index], device),  # host values: uploaded without a wait
                ref_query_logp=host_to_device(ref_query_logp[rollout.prompts[mb.index]], device),
                query_weight=None if query_weight[m] is None else host_to_device(query_weight[m], device),
                old_logp=None if old_logp is None else old_logp[m], ref_logp=ref_logp,
                rollout_logp=batch.rollout_logp, host_layout=batch.host_layout,  # pack's: no read to plan the chunks
                workspace_bytes=cfg.trainer.loss_workspace_mib << 20,
                **{**options, "top_entropy_gather": entropy_pool(mb.weight) if D.world_size() > 1 else None,
                   "entropy_coef": step_entropy_coef(options, mb.response_rows)})
            nonfinite = nonfinite + (nonfinite > 0) + ~torch.isfinite(out.loss.detach())  # counted as before
            # Every rank runs every backward (ZeRO reduces gradients inside it, so skipping one would hang the
            # others): a stand-in, or a rank that has seen a non-finite loss, runs it with weight 0, and a
            # non-finite step is then discarded on all ranks.
            scale = (nonfinite == 0) * (D.data_parallel_loss_scale() * mb.weight)
            updater.backward(out.loss * scale, m == len(plan.micro_batches) - 1)
        summed = {name: kernel_name for name, kernel_name in SUMMED_METRICS.items() if kernel_name in out.metrics}
        for name in summed:  # stand-ins too: every rank then sums the same names
            sums.setdefault(name, 0.0)
        if "rollout_logp_gap_max" in out.metrics and gap_max is None:
            gap_max = 0.0
        if not mb.weight:
            continue
        tokens = out.metrics["response_tokens"].double()
        sums["loss"] = sums["loss"] + out.loss.detach().double()
        for name, kernel_name in summed.items():
            value = out.metrics[kernel_name].double()
            sums[name] = sums[name] + (value * tokens if name in TOKEN_MEAN_METRICS else value)
        if gap_max is not None:
            gap_max = torch.maximum(on_device(gap_max, device), out.metrics["rollout_logp_gap_max"].double())
        del hidden, out
    # the one host read of the step: every sum, the gap and the non-finite count together
    device = plan.micro_batches[0].batch.targets.device if plan.micro_batches else torch.device("cpu")
    values = [*sums.values(), 0.0 if gap_max is None else gap_max, nonfinite]
    *totals, gap, count = torch.stack([on_device(value, device) for value in values]).tolist()
    return dict(zip(sums, totals)), None if gap_max is None else gap, int(count)


def on_device(value, device: torch.device) -> torch.Tensor:
    """`value` (a number, or a 0-dim tensor on `device`) as a 0-dim fp64 tensor on `device`, with no upload."""
    if isinstance(value, torch.Tensor):
        return value.double()
    return torch.full((), value, dtype=torch.float64, device=device)


def apply_update(cfg: Config, updater: Updater, nonfinite: int, state: TrainState, prompts: list[int]) -> float:
    """Step the optimizer unless a rank saw a non-finite loss or the gradient is not finite (the step is then
    skipped and counted in state.nonfinite_skipped, or raises FloatingPointError under on_nonfinite=stop).
    Returns the global grad norm (nan when none was computed)."""
    bad = D.all_reduce_sum(int(nonfinite)) > 0
    grad_norm = float("nan")
    if bad:
        updater.discard()
    else:
        grad_norm, applied = updater.step()
        bad = not applied
        if applied and not math.isfinite(grad_norm):
            log.warning("DeepSpeed reported a non-finite grad norm at optimizer step %d (the step was applied)",
                        state.opt_step + 1)
    if bad:
        state.nonfinite_skipped += 1
        message = (f"non-finite loss or gradient at optimizer step {state.opt_step + 1} (rollout step "
                   f"{state.rollout_step + 1}); prompts {sorted(set(prompts))[:8]}")
        if cfg.trainer.on_nonfinite == "stop":
            raise FloatingPointError(message + ". No update was applied for this step. Set trainer.on_nonfinite=skip "
                                     "to skip such steps; resume from the last checkpoint with --resume.")
        log.warning("%s: step skipped (%d skipped so far)", message, state.nonfinite_skipped)
    return grad_norm


def optimizer_step(cfg: Config, updater: Updater, ref_model, plan: StepPlan, old_logp: list[torch.Tensor] | None,
                   query_weight: list[torch.Tensor | None], ref_query_logp: torch.Tensor, state: TrainState,
                   logit_options: dict) -> dict:
    """Accumulate the loss over the plan's micro-batches and take one optimizer step. Returns the metrics record
    (without the step counters and timings). The plan holds samples (the loop skips a step that filtering
    emptied on every rank, before its w(q) are planned)."""
    sums, gap_max, nonfinite = accumulate_loss(cfg, updater, ref_model, plan, old_logp, query_weight, ref_query_logp,
                                               logit_options)
    lr = updater.lr
    grad_norm = apply_update(cfg, updater, nonfinite, state, plan.rollout.prompts.tolist())
    weight_sum = sum(float(w.sum()) for mb, w in zip(plan.micro_batches, query_weight) if mb.weight and w is not None)
    return step_record(cfg, plan, sums, gap_max, weight_sum, grad_norm=grad_norm, lr=lr,
                       nonfinite_skipped=state.nonfinite_skipped)
