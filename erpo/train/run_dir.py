"""Whether a run directory suits `erpo train` as asked (a fresh run, or --resume), checked before anything loads
(`check_run_dir`) and, once the training prompts are tokenized, before any model (`check_resumed_training_set`).

A finished run, an unfinished one without --resume, --resume with nothing to resume, with another LR schedule
length or with other training prompts: each is a UserError naming the directory and what to do.
"""
from __future__ import annotations

import logging
from pathlib import Path

from erpo.config import Config, updates_per_rollout
from erpo.errors import MissingInputError, UserError
from erpo.manifest import newest_sound_meta
from erpo.storage_errors import file_in_the_way
from erpo.train.checkpoint import CheckpointManager

log = logging.getLogger("erpo")


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
    blocking = file_in_the_way(out_dir)
    if blocking is not None:
        raise UserError(f"--output-dir {out_dir}: {blocking} is a file, not a directory; give the run's directory (a "
                        "new one, or a run's to --resume)")
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


def training_set_mismatch(saved: dict, here: dict) -> str | None:
    """How the training set a checkpoint recorded (`erpo.tasks.data.prompt_set_identity`) differs from this run's,
    None when it does not."""
    if saved == here:
        return None
    if saved["prompts"] != here["prompts"]:
        return f"{saved['prompts']} prompts then, {here['prompts']} now"
    what = "other prompt token ids" if saved["prompt_ids"] != here["prompt_ids"] else "other gold answers"
    return f"{here['prompts']} prompts then and now, {what}"


def check_resumed_training_set(cfg: Config, training_set: dict) -> None:
    """UserError when the checkpoint that --resume continues trained on other prompts than `training_set`, this
    run's (`erpo.tasks.data.prompt_set_identity`): its sampler's shuffle and position would apply to other prompts.
    A checkpoint that records none (an older erpo's) is resumed with a warning. Read from the newest sound checkpoint,
    as `check_run_dir` does, before any model loads and before the reference cache is looked up (whose advice for
    prompts it lacks, rebuilding it, would lose the cache the run trains against); an older one that `load` may fall
    back to is of the same run."""
    out_dir = Path(cfg.output_dir)
    meta = newest_sound_meta([path for _, path in CheckpointManager(out_dir, keep_last=None).complete_checkpoints()])
    saved = meta["state"].get("training_set")
    if saved is None:
        log.warning("--resume %s: checkpoint step-%d records no training set (saved by an older erpo): resuming "
                    "without checking that the data is the one the run started with; its next checkpoints record "
                    "it", out_dir, meta["step"])
        return
    problem = training_set_mismatch(saved, training_set)
    if problem:
        raise UserError(f"--resume {out_dir}: the checkpoint trained on another training set ({problem}): its data "
                        "order and position would apply to other prompts; resume with the data it started with "
                        "(its data.* settings and files, the same rows kept), or start a new run with another "
                        "--output-dir")
