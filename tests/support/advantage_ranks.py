"""`erpo train`'s rollout stage over 6 prompts x 2 responses with a stand-in engine whose responses decode to fixed
rewards (one None: a sample no reward function scores), on one rank or as one of several: the advantages each rank
computes, keyed by (prompt, response)."""
import torch

from erpo.config import Config, apply_overrides, resolve
from erpo.rollout.engine import RolloutBatch
from erpo.tasks.data import PromptSet
from erpo.tasks.trainer_progress import TrainerProgress
from erpo.train.rollout_stage import rollout_stage

N = 2
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, None, 0.0, 1.0, 1.0, 1.0]   # prompt p's responses: 2p, 2p + 1
PROMPTS = PromptSet(records=[{} for _ in range(6)], prompts=[f"q{p}" for p in range(6)],
                    prompt_ids=[[p + 3] for p in range(6)], answers=["7"] * 6)
CASES = [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"), ("rloo", "batch"), ("reinforce", "none"),
         ("reinforce", "batch")]


class FixedEngine:
    """Response j of prompt p is the token 2p + j (prompt p's ids are [p + 3])."""

    def wake_up(self):
        pass

    def sleep(self):
        pass

    def generate(self, prompt_ids, *, n, **sampling):
        prompts = [ids[0] - 3 for ids in prompt_ids]
        return RolloutBatch(prompt_index=[i for i in range(len(prompts)) for _ in range(n)],
                            prompt_ids=[ids for ids in prompt_ids for _ in range(n)],
                            response_ids=[[N * p + j] for p in prompts for j in range(n)],
                            response_logp=None, truncated=[False] * (n * len(prompts)))


class RewardTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return str(REWARDS[ids[0]])


def read_reward(prompts, completions, **columns):
    return [None if c == "None" else float(c) for c in completions]


def advantages_by_sample(estimator: str, scale_rewards: str) -> dict:
    """{"p,j": advantage} of this rank's samples (2 prompts per optimizer step, 3 optimizer steps)."""
    cfg = resolve(apply_overrides(Config(), [f"rollout.n={N}", "trainer.rollout_batch_size=6",
                                             "trainer.update_batch_size=2", f"algorithm.advantage={estimator}",
                                             f"algorithm.scale_rewards={scale_rewards}"]))
    out = {}
    progress = TrainerProgress(global_step=0, max_steps=3, epoch=0.0, is_world_process_zero=True,
                               is_local_process_zero=True)
    for rollout in rollout_stage(cfg, FixedEngine(), PROMPTS, RewardTokenizer(), [read_reward], list(range(6)), 0,
                                 progress):
        for s in range(len(rollout)):
            out[f"{int(rollout.prompts[s])},{rollout.response_ids[s][0] % N}"] = float(rollout.advantages[s])
    return out


def all_cases() -> dict:
    return {f"{e}/{s}": advantages_by_sample(e, s) for e, s in CASES}


def expected_single_process(estimator: str, scale_rewards: str) -> dict:
    """The same advantages from erpo.train.advantages on the whole batch (what one process computes)."""
    from erpo.train.advantages import compute_advantages
    rewards = torch.tensor([torch.nan if r is None else r for r in REWARDS])
    adv = compute_advantages(rewards, N, estimator=estimator, scale_rewards=scale_rewards)
    return {f"{i // N},{i % N}": float(a) for i, a in enumerate(adv)}
