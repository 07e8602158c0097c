"""The plan of one optimizer step: its kept samples cut into micro-batches and packed once, with their global
normalizers; used by the old-log-prob pass before the rollout step's first update and by the update itself.

Every rank runs as many micro-batches as the busiest one (model forwards are collective under ZeRO-3, and ZeRO
reduces gradients inside every backward): a rank with fewer runs stand-ins, micro-batches of weight 0 over its
first sample, whose loss is multiplied by 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from erpo import distributed as D
from erpo.config import Config
from erpo.reference.cache import compute_query_logp
from erpo.sequences import PackedBatch, pack, scored_token_logp
from erpo.tasks.data import PromptSet
from erpo.train.rollout_stage import Rollout
from erpo_kernels import MAX_QUERY_WEIGHT, query_weights


@dataclass
class MicroBatch:
    index: torch.Tensor    # [B] long: positions in the step's Rollout
    weight: float          # 1.0, or 0.0 for a stand-in (runs forward and backward, counts for nothing)
    batch: PackedBatch

    @property
    def response_rows(self) -> int:
        """Response tokens scored in this micro-batch (read from the host copy of its layout: no device read)."""
        return int((self.batch.host_layout[0] == 2).sum())


@dataclass
class StepPlan:
    rollout: Rollout
    micro_batches: list[MicroBatch]
    num_items: int         # response tokens scored in the step, over all ranks (the loss's token normalizer)
    num_seqs: int          # samples kept in the step, over all ranks (the loss's sequence normalizer)


def pack_rollout(cfg: Config, rollout: Rollout, index: torch.Tensor, ps: PromptSet, pad_id: int, device) -> PackedBatch:
    """Samples `index` of `rollout` packed for the model (truncated responses unscored under mask_truncated)."""
    idx = index.tolist()
    scored = [not (cfg.algorithm.mask_truncated and bool(rollout.truncated[i])) for i in idx]
    rollout_logp = None if rollout.rollout_logp is None else [rollout.rollout_logp[i] for i in idx]
    return pack([ps.prompt_ids[int(rollout.prompts[i])] for i in idx], [rollout.response_ids[i] for i in idx], pad_id,
                device, scored, rollout_logp)


def plan_step(cfg: Config, rollout: Rollout, ps: PromptSet, pad_id: int, device) -> StepPlan:
    """Micro-batches of `trainer.micro_batch_size` kept samples, packed, padded with stand-ins to the busiest
    rank's count. Collective: one max and one sum over ranks."""
    size = cfg.trainer.micro_batch_size
    kept = rollout.keep.nonzero().flatten()
    micro_batches = [MicroBatch(kept[i:i + size], 1.0, pack_rollout(cfg, rollout, kept[i:i + size], ps, pad_id, device))
                     for i in range(0, len(kept), size)]
    missing = D.all_reduce_max(len(micro_batches)) - len(micro_batches)
    if missing:
        first = torch.zeros(1, dtype=torch.long)
        stand_in = MicroBatch(first, 0.0, pack_rollout(cfg, rollout, first, ps, pad_id, device))
        micro_batches += [stand_in] * missing
    response_rows = sum(mb.response_rows for mb in micro_batches if mb.weight)
    local = torch.tensor([response_rows, len(kept)])
    num_items, num_seqs = D.all_reduce_sum(local).tolist()
    return StepPlan(rollout, micro_batches, num_items, num_seqs)


def old_logprobs(plan: StepPlan, model, temperature: float, logit_options: dict) -> list[torch.Tensor]:
    """The behaviour policy's log-probs [R] of each micro-batch of `plan` under `model` (before any update of the
    rollout step), in the plan's micro-batch order; `logit_options`: the model's logit transform, read once."""
    return [scored_token_logp(model, mb.batch, temperature, logit_options=logit_options)
            for mb in plan.micro_batches]


def plan_query_weights(cfg: Config, plan: StepPlan, model, ps: PromptSet, pad_id: int,
                       static_weight: torch.Tensor, logit_options: dict) -> list[torch.Tensor | None]:
    """w(q) [B] of each micro-batch (None each when algorithm.query_weight is "none"): the cached static weights, or
    ("current", clipped to [0, MAX_QUERY_WEIGHT]; "current-unclipped", the official code's weight) weights
    recomputed from `model` over the step's samples on all ranks (collective). A stand-in gets any valid weight."""
    mode = cfg.algorithm.query_weight
    prompts = [plan.rollout.prompts[mb.index] for mb in plan.micro_batches]
    if mode == "static":
        return [static_weight[p] for p in prompts]
    if mode not in ("current", "current-unclipped"):
        return [None] * len(prompts)
    # ell(q) needs the prompt rows only: one forward over the prompts of each micro-batch (stand-ins too)
    def score(batch):  # as the loss scores, with the model's logit transform (`logit_options`, read once)
        return scored_token_logp(model, batch, cfg.rollout.temperature, logit_options=logit_options)

    current = [compute_query_logp(model, [ps.prompt_ids[i] for i in p.tolist()], pad_id=pad_id, batch_size=len(p),
                                  temperature=cfg.rollout.temperature, score=score) for p in prompts]
    local = torch.cat([c for mb, c in zip(plan.micro_batches, current) if mb.weight]
                      or [torch.zeros(0, dtype=torch.float64)])
    everyone = D.all_gather_object(local.tolist())
    all_w = query_weights(torch.tensor([v for part in everyone for v in part], dtype=torch.float64),
                          max_weight=None if mode == "current-unclipped" else MAX_QUERY_WEIGHT)
    offset = sum(len(part) for part in everyone[:D.rank()])
    sizes = [len(mb.index) if mb.weight else 0 for mb in plan.micro_batches]
    return [w if mb.weight else torch.ones(1)
            for mb, w in zip(plan.micro_batches, all_w[offset:offset + len(local)].split(sizes))]
