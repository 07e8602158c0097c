"""The training metrics: each name defined once, reduced over ranks once, and written by one writer to
metrics.jsonl, TensorBoard (tb/, as train/NAME) and the progress bar.

Names follow TRL / verl where they have one (`clip_ratio` is the kernel's `clip_frac`). Sample statistics are
means over the step's samples on all ranks; loss terms are sums of the micro-batch losses, which are already
normalized by the global counts; token statistics are means over the step's response tokens. The reward metrics
under TRL's names (`reward`, `reward_std`, `rewards/NAME/mean`, `rewards/NAME/std`, `frac_reward_zero_std`) are
TRL 1.16 GRPOTrainer's formulas on the step's samples: nanmean, Bessel-corrected nanstd, a sample no function
scored left out. So are the completion metrics (`completions/mean_length`, `/min_length`, `/max_length`,
`/clipped_ratio`, `/mean_terminated_length`, `/min_terminated_length`, `/max_terminated_length`): a response's
length is its token count, EOS included, and it is clipped when it reached rollout.max_new_tokens without EOS.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch

from erpo import distributed as D
from erpo.config import Config
from erpo.progress import progress

log = logging.getLogger("erpo")

# metrics.jsonl name -> the kernel's `LossOutput.metrics` name, for the token-weighted means
TOKEN_MEAN_METRICS = {"policy_kl": "policy_kl", "entropy": "entropy", "clip_ratio": "clip_frac",
                      "ratio_mean": "ratio_mean", "rollout_is_weight": "rollout_is_weight",
                      "rollout_logp_gap_abs": "rollout_logp_gap_abs"}
# metrics.jsonl name -> the kernel's name, for every loss metric summed over micro-batches (loss terms and token means)
SUMMED_METRICS = {"qkl": "qkl", "pg_loss": "pg_loss", **TOKEN_MEAN_METRICS}


def finite_or_none(x) -> float | None:
    """float(x), or None (JSON null) when it is nan or infinite."""
    x = float(x)
    return x if math.isfinite(x) else None


def sample_std(total: float, total_sq: float, count: float) -> float | None:
    """The Bessel-corrected std of `count` values from their sum and sum of squares (0 where rounding makes the
    variance < 0), as TRL's `nanstd` of the values; None (TRL: NaN) for fewer than two values."""
    if count < 2:
        return None
    return math.sqrt(max(0.0, (total_sq - total * total / count) / (count - 1)))


def extremes(values: torch.Tensor) -> list[float]:
    """[max, -min] of `values` (a 1-D tensor), [-inf, -inf] when it is empty: their max over ranks is the global
    [max, -min] whatever a rank holds."""
    return [values.max().item(), -values.min().item()] if len(values) else [-math.inf, -math.inf]


def completion_lengths(total: dict, length_extremes: list[float], terminated_extremes: list[float]) -> dict:
    """TRL 1.16 GRPOTrainer's `completions/*` metrics of the step from the sums over ranks `total` ("samples",
    "length", "clipped", "terminated_length") and the max over ranks of `extremes` of every response's length and of
    the terminated ones' (tokens, EOS included). As TRL, the terminated lengths are 0 when every response was clipped
    (TRL takes the mean, min and max of a lone 0)."""
    samples, terminated = total["samples"], total["samples"] - total["clipped"]
    lengths = {"completions/mean_length": total["length"] / samples, "completions/min_length": -length_extremes[1],
               "completions/max_length": length_extremes[0], "completions/clipped_ratio": total["clipped"] / samples}
    if not terminated:
        return {**lengths, "completions/mean_terminated_length": 0.0, "completions/min_terminated_length": 0.0,
                "completions/max_terminated_length": 0.0}
    return {**lengths, "completions/mean_terminated_length": total["terminated_length"] / terminated,
            "completions/min_terminated_length": -terminated_extremes[1],
            "completions/max_terminated_length": terminated_extremes[0]}


def step_record(cfg: Config, plan, loss_sums: dict, gap_max: float | None, weight_sum: float, *, grad_norm: float,
                lr: float, nonfinite_skipped: int) -> dict:
    """The metrics of one optimizer step over all ranks (one sum and one max over ranks). loss_sums: this rank's
    sums from `update_step.accumulate_loss` ("loss" and those of SUMMED_METRICS that apply: the others are logged as
    null, like a non-finite value); gap_max: its largest rollout log-prob gap (None when that metric does not apply);
    weight_sum: its sum of w(q) over its samples; plan: the step's `StepPlan` (its counts are already global)."""
    rollout = plan.rollout
    lengths = torch.tensor([len(ids) for ids in rollout.response_ids], dtype=torch.float64)
    terminated = lengths[~rollout.truncated.bool()]
    local = {"samples": len(rollout), "reward_std_zero": int(rollout.reward_std_zero.sum()),
             "accuracy": sum(rollout.correct.tolist()), "length": lengths.sum().item(),
             "clipped": len(lengths) - len(terminated), "terminated_length": terminated.sum().item(),
             "filtered_frac": len(rollout) - int(rollout.keep.sum()), "query_weight": weight_sum, **loss_sums}
    # the total ("reward", NaN where no function scored) and each function's values ("rewards/NAME", NaN where it
    # returned None), over the samples that have one; the same functions, in the same order, on every rank
    given_values = {"reward": rollout.rewards,
                    **{f"rewards/{name}": values for name, values in rollout.reward_parts.items()}}
    for key, values in given_values.items():
        given = values[~values.isnan()]
        local.update({f"{key}/count": len(given), f"{key}/sum": given.sum().item(),
                      f"{key}/sum_sq": given.square().sum().item()})
    total = dict(zip(local, D.all_reduce_sum(torch.tensor(list(local.values()), dtype=torch.float64)).tolist()))
    # the lengths' extremes and the rollout log-prob gap (-inf: none on this rank, or the metric does not apply)
    most = D.all_reduce_max(torch.tensor([*extremes(lengths), *extremes(terminated),
                                          -math.inf if gap_max is None else gap_max], dtype=torch.float64)).tolist()
    tokens = max(plan.num_items, 1)
    record = {"accuracy": total["accuracy"] / total["samples"], **completion_lengths(total, most[0:2], most[2:4]),
              "filtered_frac": total["filtered_frac"] / total["samples"]}

    def mean_std(key):   # TRL's nanmean and nanstd of `key`'s values: null where fewer than 1 / 2 are given
        count = total[f"{key}/count"]
        return (total[f"{key}/sum"] / count if count else None,
                sample_std(total[f"{key}/sum"], total[f"{key}/sum_sq"], count))
    record["reward"], record["reward_std"] = mean_std("reward")
    for key in given_values:   # TRL's rewards/NAME/mean and /std, over the samples the function scored
        if key != "reward":
            record[f"{key}/mean"], record[f"{key}/std"] = mean_std(key)
    record["frac_reward_zero_std"] = total["reward_std_zero"] / total["samples"]

    def summed(name):  # a loss term's sum or a token mean; null where the metric does not apply
        if name not in total:
            return None
        return finite_or_none(total[name] / tokens if name in TOKEN_MEAN_METRICS else total[name])
    record.update({
        "qkl": summed("qkl"), "loss": finite_or_none(total["loss"]), "pg_loss": summed("pg_loss"),
        **{name: summed(name) for name in TOKEN_MEAN_METRICS},
        "rollout_logp_gap_max": None if gap_max is None else finite_or_none(most[4]),
        # num_seqs is already global: the weight sum alone is reduced
        "query_weight_mean": total["query_weight"] / plan.num_seqs if cfg.algorithm.query_weight != "none" else None,
        "grad_norm": finite_or_none(grad_norm),
        "num_samples": plan.num_seqs,
        "response_tokens": plan.num_items,
        "nonfinite_skipped": nonfinite_skipped,
        "lr": lr,
    })
    return record


def drop_steps_after(path: Path, step: int) -> int:
    """Rewrite metrics.jsonl at `path` without the records of optimizer steps after `step`: those a run logged
    after its newest checkpoint before it was stopped (Ctrl-C twice, a kill), and a last line cut short by the kill.
    Returns how many lines were dropped (nothing is rewritten when none is)."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):   # a line cut short by a kill: not a record
            pass
    if len(kept) < len(lines):
        partial = path.with_name(f".{path.name}.resume")
        partial.write_text("".join(kept))
        os.replace(partial, path)
        log.info("%s: dropped %d record(s) after step %d, the newest checkpoint's (the resumed run logs them again)",
                 path, len(lines) - len(kept), step)
    return len(lines) - len(kept)


class MetricsWriter:
    """metrics.jsonl (one JSON record per optimizer step), TensorBoard and the progress bar, on rank 0 only.

    A fresh run starts its own log (a crash before the first checkpoint leaves nothing to continue); a resumed one
    first drops the records of the steps after its checkpoint (`done_steps`), which it logs again, then appends: the
    log never holds a step twice (nor does TensorBoard show one twice)."""

    def __init__(self, cfg: Config, out_dir: Path, *, resume: bool, total_steps: int, done_steps: int):
        main = D.is_main()
        if resume and main:
            drop_steps_after(out_dir / "metrics.jsonl", done_steps)
        self.file = open(out_dir / "metrics.jsonl", "a" if resume else "w") if main else None
        self.tensorboard = None
        if cfg.logging.tensorboard and main:
            from torch.utils.tensorboard import SummaryWriter
            # resumed: TensorBoard hides the earlier run's events from the first step logged again on (the
            # purge step), as metrics.jsonl drops them; else a step past the checkpoint shows twice
            self.tensorboard = SummaryWriter(str(out_dir / "tb"), purge_step=done_steps + 1 if resume else None)
        self.progress = progress(total_steps, f"{cfg.algorithm.name} train", "step", initial=done_steps,
                                 enabled=cfg.logging.progress_bar and main)

    def write(self, record: dict) -> None:
        """Log one optimizer step's record (it holds "step")."""
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tensorboard.add_scalar(f"train/{key}", value, record["step"])
        reward = "n/a" if record["reward"] is None else f"{record['reward']:.3f}"   # null: no sample was scored
        self.progress.set_postfix(reward=reward, qkl=f"{record['qkl'] or 0:.4f}")
        self.progress.update(1)

    def close(self) -> None:
        for sink in (self.progress, self.tensorboard, self.file):
            if sink is not None:
                sink.close()
