"""Crash-safe training checkpoints: the manager that saves, finds, prunes and restores them.

Layout of one checkpoint, `OUTPUT_DIR/checkpoints/step-N/`:
    meta.json          step, world size, engine kind, the trainer's `state` (JSON) and the manifest of every other
                       file (size, SHA-256: `erpo.manifest`); written last
    rng/rank-R.pt      python / numpy / torch / CUDA RNG states of rank R
    engine/...         DeepSpeed engine: DeepSpeed's own files (model, ZeRO optimizer shards, scheduler)
    model.pt, optimizer.pt, scheduler.pt     plain torch bundle (TorchBundle)
    hf/                the model (+ tokenizer) in Hugging Face format, when saved with `export=True`; for a LoRA
                       model its adapters (`erpo.models.lora.export_adapter`)

The model's frozen parameters (a LoRA model's base weights) are not saved: they are the weights it was loaded
with, and a resumed run loads them again (the trainer checks they are the same through the reference cache's
model fingerprint). meta.json lists the trainable parameters; a model that trains others is refused on load.

A checkpoint is built in `checkpoints/.tmp-step-N/`, every file fsynced, then renamed to `step-N` in one
atomic rename: a process killed at any moment leaves either no `step-N` or a complete one, and the
previous checkpoints untouched. `latest()` only ever sees complete ones.

A write that fails on one rank (full disk, I/O error) must not leave the others waiting in the save's next
collective for a rank that gave up (they would die with the process group's traceback when it exits). So the ranks
agree after each phase of writes (`erpo.storage_errors.agree_on_writes`): the rank that failed raises its own error,
every other rank a `StoppedElsewhere` naming it, rank 0 removes the half-written directory, and all stop at once.
Inside DeepSpeed's save, whose writes sit between its own barriers, a failed write is held back until its last
barrier (`HeldBackWrites`).

The `engine` argument of save/load is either a `deepspeed.DeepSpeedEngine` (saved with its collective
`save_checkpoint` / `load_checkpoint`: every rank must call save/load) or a `TorchBundle(model,
optimizer, scheduler)` for plain single-process torch training (rank 0 writes it).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from erpo import distributed as dist_utils
from erpo.atomic import TMP_PREFIX, fsync_dir, fsync_tree
from erpo.deepspeed_internals import held_back_writes
from erpo.manifest import (
    CHECKPOINTS_DIR,
    build_manifest,
    complete_checkpoints,
    newest_intact,
    require_intact,
    sealed_json,
)
from erpo.models.export import HF_DIR, export_hf
from erpo.models.weights import parameter_names
from erpo.storage_errors import agree_on_writes
from erpo.train.rng import capture_rng_state, restore_rng_state

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TRASH_PREFIX = ".trash-"
DEEPSPEED_TAG = "engine"


@dataclass
class TorchBundle:
    """What a plain torch run checkpoints: the model, and optionally its optimizer and LR scheduler
    (anything with `state_dict()` / `load_state_dict()`)."""
    model: torch.nn.Module
    optimizer: Any = None
    scheduler: Any = None


def engine_kind(engine: Any) -> str:
    """"deepspeed" or "torch"; TypeError for anything else."""
    if dist_utils.is_deepspeed_engine(engine):
        return "deepspeed"
    if isinstance(engine, TorchBundle):
        return "torch"
    raise TypeError(f"engine must be a deepspeed.DeepSpeedEngine or an erpo.train.checkpoint.TorchBundle, "
                    f"got {type(engine).__name__}")

# --------------------------------------------------------------------------------------- durable files

def remove_tree(path: Path) -> None:
    """Delete a directory by first renaming it out of sight, so a crash mid-delete leaves no half-gone
    checkpoint under a valid name."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    path.rename(trash)
    shutil.rmtree(trash)


# ------------------------------------------------------------------------------------------ manager

def write_training_state(engine: Any, kind: str, directory: Path) -> None:
    """The model's trainable weights (frozen ones, e.g. a LoRA base, are left out), optimizer and scheduler into
    `directory`: DeepSpeed's own collective save (a failed write raised after its last barrier), or rank 0's
    torch.save of the TorchBundle's parts."""
    if kind == "deepspeed":
        with held_back_writes(engine) as writes:
            engine.save_checkpoint(str(directory), tag=DEEPSPEED_TAG, client_state={}, save_latest=False,
                                   exclude_frozen_parameters=bool(parameter_names(engine.module, trainable=False)))
        writes.raise_failure()
    elif dist_utils.is_main():
        frozen = set(parameter_names(engine.model, trainable=False))
        torch.save({k: v for k, v in engine.model.state_dict().items() if k not in frozen}, directory / "model.pt")
        if engine.optimizer is not None:
            torch.save(engine.optimizer.state_dict(), directory / "optimizer.pt")
        if engine.scheduler is not None:
            torch.save(engine.scheduler.state_dict(), directory / "scheduler.pt")


class CheckpointManager:
    """Saves, finds and restores training checkpoints under `output_dir/checkpoints/`.

    output_dir: the run directory (a path whose last component is already "checkpoints" is used as is).
    keep_last: how many complete checkpoints to keep (oldest deleted after each save); None keeps all.
    keep_every: K > 0 also keeps, besides the newest `keep_last`, every checkpoint whose step is a multiple of K (a
    run's history, for `erpo eval --model RUN_DIR@all`); 0 keeps none besides them.
    `before_commit`: optional callable run on rank 0 after every file of a checkpoint is written and
    before the commit rename (tests use it to kill a process mid-save).
    """

    def __init__(self, output_dir: str | os.PathLike, keep_last: int | None = 3, keep_every: int = 0):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                      or keep_last < 1):
            raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        if isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 0:
            raise ValueError(f"keep_every must be an int >= 0 (0: off), got {keep_every!r}")
        root = Path(output_dir)
        self.root = root if root.name == CHECKPOINTS_DIR else root / CHECKPOINTS_DIR
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.before_commit: Callable[[], None] | None = None

    # -- discovery
    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, oldest first (`erpo.manifest.complete_checkpoints`)."""
        return complete_checkpoints(self.root)

    def latest(self) -> str | None:
        """Path of the newest complete checkpoint, or None. Temporary and partially deleted ones are ignored."""
        found = self.complete_checkpoints()
        return str(found[-1][1]) if found else None

    # -- save
    def save(self, step: int, engine: Any, state: dict, *, export: bool = False, tokenizer: Any = None) -> str:
        """Write checkpoint `step` atomically and return its path; collective under DeepSpeed.

        engine: DeepSpeedEngine or TorchBundle (see module doc). state: the trainer's JSON-serializable
        progress (e.g. {"step": 7, "prompts_consumed": 448, "reference_cache_id": "ab12..."}).
        export: also write the model (a transformers model) and `tokenizer` with `export_hf` into `hf/`,
        loadable by `from_pretrained` and `erpo eval`; part of the same atomic commit.
        Saving a step that already has a complete checkpoint returns it unchanged; saving a step lower than
        an existing checkpoint's is a ValueError (a different run's checkpoints are in the directory).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        try:
            state_json = json.dumps(state)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"state must be JSON-serializable: {exc}") from exc
        kind = engine_kind(engine)
        final = self.root / f"step-{step}"
        if (final / "meta.json").is_file():
            return str(final)
        later = [s for s, _ in self.complete_checkpoints() if s > step]
        if later:
            raise ValueError(f"cannot save step {step}: {self.root} already holds a checkpoint of step {max(later)} "
                             f"from another run; resume from it or use a new output directory")
        tmp = self.root / f"{TMP_PREFIX}step-{step}"

        def prepare() -> None:
            if dist_utils.is_main():
                self.root.mkdir(parents=True, exist_ok=True)
                self.remove_stale()
                tmp.mkdir()
                (tmp / "rng").mkdir()

        def commit() -> None:
            if dist_utils.is_main():
                meta = {"format_version": FORMAT_VERSION, "step": step, "world_size": dist_utils.world_size(),
                        "engine": kind, "state": json.loads(state_json),
                        "trainable_parameters": parameter_names(trained_model(engine), trainable=True),
                        "files": files}
                (tmp / "meta.json").write_text(sealed_json(meta))
                fsync_tree(tmp)
                if self.before_commit is not None:
                    self.before_commit()
                if final.exists():  # an incomplete directory under the final name (not written by this class)
                    remove_tree(final)
                tmp.rename(final)
                fsync_dir(self.root)
                self.prune()

        # Each phase of writes ends with the ranks' agreement (a collective, in place of a barrier).
        def agreed(write: Callable[[], None]) -> None:
            agree_on_writes(write, f"saving checkpoint step-{step}", self.root, cleanup=self.remove_stale)

        agreed(prepare)
        agreed(lambda: torch.save(capture_rng_state(), tmp / "rng" / f"rank-{dist_utils.rank()}.pt"))
        agreed(lambda: write_training_state(engine, kind, tmp))
        if export:
            agreed(lambda: export_hf(engine if kind == "deepspeed" else engine.model, tokenizer, tmp / HF_DIR))
        files = build_manifest(tmp)   # collective: every rank digests a share
        agreed(commit)
        return str(final)

    def remove_stale(self) -> None:
        """Delete leftovers of interrupted saves and deletions (rank 0, before a save)."""
        for child in self.root.iterdir():
            if child.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and child.is_dir():
                shutil.rmtree(child)

    def prune(self) -> None:
        """Keep only the newest `keep_last` complete checkpoints and those of every `keep_every`-th step."""
        if self.keep_last is None:
            return
        for step, path in self.complete_checkpoints()[:-self.keep_last]:
            if not (self.keep_every and step % self.keep_every == 0):
                remove_tree(path)

    # -- load
    def load(self, engine: Any, path: str | os.PathLike | None = None) -> dict:
        """Restore `engine` and this rank's RNG states from `path` (default: the newest checkpoint whose files are
        intact, `erpo.manifest.newest_intact`); collective under DeepSpeed. Returns the saved `state`
        dict, with "step" set to the checkpoint's step.

        FileNotFoundError when there is no complete checkpoint; DamagedCheckpointError (a UserError) when none
        is intact, or `path` is damaged; ValueError when the checkpoint was written by a different kind of engine.
        """
        kind = engine_kind(engine)
        if path is None:   # collective: the newest one intact on every rank; newer damaged ones set aside
            path = newest_intact([p for _, p in self.complete_checkpoints()])
            if path is None:
                raise FileNotFoundError(f"no complete checkpoint under {self.root}")
        else:
            require_intact(Path(path))
        path = Path(path)
        meta_path = path / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
        meta = json.loads(meta_path.read_text())
        if meta["engine"] != kind:
            raise ValueError(f"checkpoint {path} was saved from a {meta['engine']} engine, cannot load it into "
                             f"a {kind} engine")
        saved, here = meta.get("trainable_parameters"), parameter_names(trained_model(engine), trainable=True)
        if saved is not None and saved != here:   # None: saved before the list was recorded, not checked
            differ = sorted(set(saved) ^ set(here))
            raise ValueError(f"checkpoint {path} trains other parameters than this model ({len(saved)} saved, "
                             f"{len(here)} here; e.g. {differ[:2]}): resume with the model settings (model.lora) "
                             "it was saved with")
        if kind == "deepspeed":
            load_path, _ = engine.load_checkpoint(str(path), tag=DEEPSPEED_TAG, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True,
                                                  load_module_strict=not parameter_names(engine.module,
                                                                                         trainable=False))
            if load_path is None:
                raise FileNotFoundError(f"DeepSpeed found no checkpoint in {path / DEEPSPEED_TAG}")
        else:
            self.load_torch_bundle(engine, path)
        rng_file = path / "rng" / f"rank-{dist_utils.rank()}.pt"
        if rng_file.is_file():
            restore_rng_state(torch.load(rng_file, weights_only=True))
        else:
            logger.warning("checkpoint %s has no RNG state for rank %d (saved with world size %d, now %d): "
                           "random streams will differ from the original run", path, dist_utils.rank(),
                           meta["world_size"], dist_utils.world_size())
        return {**meta["state"], "step": meta["step"]}

    @staticmethod
    def load_torch_bundle(bundle: TorchBundle, path: Path) -> None:
        frozen = parameter_names(bundle.model, trainable=False)   # not in model.pt: loaded with the model
        bundle.model.load_state_dict(torch.load(path / "model.pt", map_location="cpu", weights_only=True),
                                     strict=not frozen)
        for name, obj in (("optimizer", bundle.optimizer), ("scheduler", bundle.scheduler)):
            if obj is None:
                continue
            file = path / f"{name}.pt"
            if not file.is_file():
                raise FileNotFoundError(f"checkpoint {path} has no {name} state ({file.name}) but a {name} was given")
            obj.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))


def trained_model(engine: Any) -> torch.nn.Module:
    """The model a DeepSpeed engine or a TorchBundle holds."""
    return engine.module if engine_kind(engine) == "deepspeed" else engine.model
