"""The rollout stage of one rollout step: generate n responses per prompt on this rank, reward them and compute
their advantages, as tensors (`Rollout`), split into the optimizer steps of the rollout step.

Prompts of every optimizer step are sharded over ranks in whole groups (`distributed.shard`), so a prompt's n
responses are generated and rewarded on one rank; the advantages' batch statistics (scale_rewards="batch",
REINFORCE's baseline) are over every rank's rewards (`rollout_advantages`), so advantages do not depend on the world
size. Reward functions are called as TRL's GRPOTrainer calls them (`compute_rewards`), with `trainer_state` the
run's `TrainerProgress`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from erpo import distributed as D
from erpo.config import Config
from erpo.tasks.data import PromptSet
from erpo.tasks.rewards import compute_rewards, math_reward
from erpo.tasks.trainer_progress import TrainerProgress
from erpo.train.advantages import compute_advantages, equal_reward_groups, reward_std


@dataclass
class Rollout:
    """S samples of this rank, grouped by prompt (n consecutive responses each)."""
    prompts: torch.Tensor              # [S] long: index into the PromptSet
    response_ids: list[list[int]]      # S token lists
    rewards: torch.Tensor              # [S] float64: weighted sum of the reward functions (NaN: none scored it)
    correct: torch.Tensor              # [S] float64: 1.0 when the math verifier accepts the answer
    truncated: torch.Tensor            # [S] bool: stopped by rollout.max_new_tokens
    advantages: torch.Tensor           # [S] float32
    keep: torch.Tensor                 # [S] bool: False when the group was filtered (all rewards equal, filter_groups)
    reward_std_zero: torch.Tensor      # [S] bool: its group's reward std (the batch's with scale_rewards="batch",
                                       # `reward_std`) is 0: TRL's is_std_zero, for frac_reward_zero_std
    rollout_logp: list[list[float]] | None  # the engine's log-prob of each response token (importance sampling)
    # each reward function's values by its name (`compute_rewards`' names), [S] float64, NaN where it returned None
    reward_parts: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, start: int, stop: int) -> Rollout:
        """Samples start..stop-1."""
        def rows(value):
            if isinstance(value, dict):
                return {name: part[start:stop] for name, part in value.items()}
            return None if value is None else value[start:stop]
        return Rollout(**{f.name: rows(getattr(self, f.name)) for f in fields(self)})


def filtered_step_warning(rollout: Rollout) -> str:
    """The warning for an optimizer step whose every group DAPO's dynamic-sampling filter (algorithm.filter_groups)
    dropped: why (equal rewards, or samples no reward function scored: NaN rewards) and, for the unscored, what to
    do."""
    unscored = torch.isnan(rollout.rewards)
    if unscored.all():
        return ("optimizer step skipped: no sample of this batch could be scored (no reward function returned a value "
                "for any of them, so algorithm.filter_groups dropped every group); make at least one reward function "
                "return a number for these samples (the warning above names the first)")
    if unscored.any():
        return ("optimizer step skipped: every group of this batch has equal rewards or no scored sample "
                "(algorithm.filter_groups)")
    return "optimizer step skipped: every group of this batch has equal rewards (algorithm.filter_groups)"


def rollout_advantages(cfg: Config, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [S] fp32, whether the std they are scaled by is 0 [S] bool) of this rank's rewards [S] (whole
    groups of rollout.n), computed over the rollout step's rewards on every rank (one all-gather; collective), as
    TRL and verl do over the global batch: a group's statistics are its own wherever it lives, the batch std and
    REINFORCE's batch mean are over all ranks' samples."""
    a = cfg.algorithm
    everyone = D.all_gather_object(rewards.tolist())
    offset = sum(len(part) for part in everyone[:D.rank()])
    every_reward = torch.tensor([r for part in everyone for r in part], dtype=rewards.dtype)
    std = reward_std(every_reward, cfg.rollout.n, a.scale_rewards)   # once: the advantages' and the zero-std test's
    advantages = compute_advantages(every_reward, cfg.rollout.n, estimator=a.advantage, scale_rewards=a.scale_rewards,
                                    std=std)
    std_zero = torch.isclose(std, torch.zeros_like(std))   # TRL's test, defaults included (atol 1e-8)
    mine = slice(offset, offset + len(rewards))
    return advantages[mine], std_zero[mine]


def math_verdicts(reward_fns, reward_values: dict[str, list], prompts: list[str], completions: list[str],
                  answers: list[str]) -> list[float]:
    """1.0 / 0.0 per sample [S]: whether the math verifier accepts its last \\boxed{} (the `accuracy` metric).
    reward_values: `compute_rewards`' per-function values, in the order of `reward_fns`. Where erpo's own `math`
    reward function is among them it has graded every sample already (its values are unweighted): those verdicts
    are reused, as math-verify judges each answer in a child process. A user's function, whatever its name, is
    not taken as the accuracy: then the samples are graded here."""
    for fn, values in zip(reward_fns, reward_values.values()):
        if fn is math_reward:
            return values
    return math_reward(prompts, completions, answers)


def score(cfg: Config, batch, ps: PromptSet, prompt_indices: list[int], tokenizer, reward_fns,
          trainer_state: TrainerProgress) -> Rollout:
    """Decode, reward and compute advantages of one generated `batch` (a `RolloutBatch` over `prompt_indices`)."""
    prompts = [prompt_indices[i] for i in batch.prompt_index]
    completions = [tokenizer.decode(r, skip_special_tokens=True) for r in batch.response_ids]
    texts = [ps.prompts[p] for p in prompts]
    keys = sorted({k for p in set(prompts) for k in ps.records[p]})
    columns = {k: [ps.records[p].get(k) for p in prompts] for k in keys}
    columns["answer"] = [ps.answers[p] for p in prompts]
    columns["completion_ids"] = batch.response_ids
    rewards, parts = compute_rewards(reward_fns, cfg.reward.weights, texts, completions, columns,
                                     trainer_state=trainer_state)
    n, a = cfg.rollout.n, cfg.algorithm
    reward_t = torch.tensor(rewards, dtype=torch.float32)
    advantages, std_zero = rollout_advantages(cfg, reward_t)
    flat = (equal_reward_groups(reward_t, n).repeat_interleave(n) if a.filter_groups
            else torch.zeros(len(rewards), dtype=torch.bool))
    if cfg.rollout.importance_sampling_correction and batch.response_logp is None:
        raise ValueError("rollout.importance_sampling_correction needs the rollout engine's sampling log-probs, but "
                         f"{cfg.rollout.engine!r} returned none; set rollout.importance_sampling_correction=false")
    return Rollout(prompts=torch.tensor(prompts, dtype=torch.long), response_ids=batch.response_ids,
                   rewards=torch.tensor(rewards, dtype=torch.float64),
                   correct=torch.tensor(math_verdicts(reward_fns, parts, texts, completions, columns["answer"]),
                                        dtype=torch.float64),
                   truncated=torch.tensor(batch.truncated, dtype=torch.bool), advantages=advantages.float(),
                   keep=~flat.bool(), reward_std_zero=std_zero,
                   rollout_logp=batch.response_logp if cfg.rollout.importance_sampling_correction else None,
                   reward_parts={name: torch.tensor([math.nan if v is None else v for v in values],
                                                    dtype=torch.float64) for name, values in parts.items()})


def rollout_stage(cfg: Config, engine, ps: PromptSet, tokenizer, reward_fns, global_prompts: list[int],
                  seed: int, trainer_state: TrainerProgress) -> list[Rollout]:
    """Generate and score this rank's share of `global_prompts` (the rollout step's prompts, update_batch_size per
    optimizer step) with one `engine.generate` call; one Rollout per optimizer step. seed: the generation seed;
    trainer_state: what the reward functions get as theirs."""
    t, r = cfg.trainer, cfg.rollout
    updates = len(global_prompts) // t.update_batch_size
    local_chunks = [D.shard(global_prompts[u * t.update_batch_size:(u + 1) * t.update_batch_size],
                            D.rank(), D.world_size()) for u in range(updates)]
    local_prompts = [p for chunk in local_chunks for p in chunk]
    engine.wake_up()
    batch = engine.generate([ps.prompt_ids[p] for p in local_prompts], n=r.n, temperature=r.temperature,
                            top_p=r.top_p, max_new_tokens=r.max_new_tokens, seed=seed)
    engine.sleep()
    rollout = score(cfg, batch, ps, local_prompts, tokenizer, reward_fns, trainer_state)
    bounds = torch.tensor([0] + [len(c) * r.n for c in local_chunks]).cumsum(0).tolist()
    return [rollout.select(bounds[u], bounds[u + 1]) for u in range(updates)]
