"""What `erpo train` checks from its config alone, before the process group, the data or any model start (and, on
the command line, before the trainer's modules load: a mistake answers in seconds): the run directory
(`run_dir.check_run_dir`), the reference cache's path (`checked_cache_path`) and the reward functions
(`load_reward_function`). Each is checked once: `check_run` returns what the checks found, which `loop.train`
takes."""
from __future__ import annotations

from dataclasses import dataclass

from erpo.config import Config
from erpo.reference.cache_path import checked_cache_path
from erpo.tasks.rewards import RewardFn, load_reward_function
from erpo.train.run_dir import check_run_dir


@dataclass(frozen=True)
class CheckedRun:
    """What `check_run` found for a run's config."""
    cache_path: str             # reference.cache_path, else OUTPUT_DIR/reference_cache.json
    reward_fns: list[RewardFn]  # reward.functions, loaded, in their order


def check_run(cfg: Config, *, resume: bool) -> CheckedRun:
    """UserError when `cfg.output_dir` cannot start a fresh run (or, with `resume`, continue one), the reference
    cache's path cannot hold the cache, or a reward function cannot be loaded; else what the run uses of them."""
    check_run_dir(cfg, resume=resume)
    return CheckedRun(cache_path=checked_cache_path(cfg),
                      reward_fns=[load_reward_function(spec) for spec in cfg.reward.functions])
