"""Whether a run directory suits `erpo train` as asked (a fresh run, or --resume), checked before anything loads.

A finished run, an unfinished one without --resume, --resume with nothing to resume or with another LR schedule
length: each is a UserError naming the directory and what to do.
"""
from __future__ import annotations

from pathlib import Path

from erpo.config import Config, updates_per_rollout
from erpo.errors import MissingInputError, UserError
from erpo.manifest import newest_sound_meta
from erpo.train.checkpoint import CheckpointManager


def schedule_mismatch(saved_steps: int | None, cfg: Config) -> str | None:
    """Why a checkpoint whose LR schedule spans `saved_steps` optimizer steps cannot continue under `cfg` (None when
    it can: same length, an unrecorded length, or a constant LR, the only schedule independent of its length)."""
    t = cfg.trainer
    updates = updates_per_rollout(cfg)
    schedule_steps = t.max_steps * updates
    constant_lr = t.warmup_ratio == 0 and t.min_lr_ratio == 1
    if saved_steps is None or saved_steps == schedule_steps or constant_lr:
        return None
    original = (f"--max-steps {saved_steps // updates}" if saved_steps % updates == 0
                else "the original trainer.max_steps and batch sizes")
    return (f"the checkpoint's LR schedule (warmup + cosine) spans {saved_steps} optimizer steps, but this config's "
            f"spans {schedule_steps} (trainer.max_steps={t.max_steps} x {updates} updates per rollout step); resume "
            f"with {original}; only a constant LR (trainer.warmup_ratio=0, trainer.min_lr_ratio=1) lets a run be "
            "extended")


def check_run_dir(cfg: Config, *, resume: bool) -> None:
    """UserError unless `cfg.output_dir` can start a fresh run (no checkpoints) or, with `resume`, holds a checkpoint
    this config can continue."""
    out_dir = Path(cfg.output_dir)
    checkpoints = CheckpointManager(out_dir, keep_last=None)
    latest = checkpoints.latest()
    if resume:
        if latest is None:
            raise MissingInputError(f"--resume: no complete checkpoint under {out_dir / 'checkpoints'}; "
                                    "drop --resume to start a fresh run there")
        # the newest one whose meta.json and file sizes are sound (digests are checked on load, by every rank)
        state = newest_sound_meta([path for _, path in checkpoints.complete_checkpoints()])["state"]
        problem = schedule_mismatch(state.get("lr_schedule_steps"), cfg)
        if problem:
            raise UserError(f"--resume {out_dir}: {problem}")
        return
    if latest is None:
        return
    if (out_dir / "final" / "config.json").is_file():
        raise UserError(f"--output-dir {out_dir}: holds a finished run (final/); choose another --output-dir "
                        "(e.g. runs/erpo-tiny-2), or delete that directory to train it again")
    raise UserError(f"--output-dir {out_dir}: holds checkpoints of an unfinished run (newest: {latest}); continue it "
                    "with --resume, or start a fresh one with another --output-dir")
