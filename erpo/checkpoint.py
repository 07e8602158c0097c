"""Crash-safe training checkpoints, graceful SIGTERM handling and the final Hugging Face export.

Layout of one checkpoint, `OUTPUT_DIR/checkpoints/step-N/`:
    meta.json          step, world size, engine kind, the trainer's `state` (JSON) and the manifest of every other
                       file (size, SHA-256: `erpo.checkpoint_manifest`); written last
    rng/rank-R.pt      python / numpy / torch / CUDA RNG states of rank R
    engine/...         DeepSpeed engine: DeepSpeed's own files (model, ZeRO optimizer shards, scheduler)
    model.pt, optimizer.pt, scheduler.pt     plain torch bundle (TorchBundle)
    hf/                the model (+ tokenizer) in Hugging Face format, when saved with `export=True`; for a LoRA
                       model its adapters (`erpo.lora.export_adapter`)

The model's frozen parameters (a LoRA model's base weights) are not saved: they are the weights it was loaded
with, and a resumed run loads them again (the trainer checks they are the same through the reference cache's
model fingerprint). meta.json lists the trainable parameters; a model that trains others is refused on load.

A checkpoint is built in `checkpoints/.tmp-step-N/`, every file fsynced, then renamed to `step-N` in one
atomic rename: a process killed at any moment leaves either no `step-N` or a complete one, and the
previous checkpoints untouched. `latest()` only ever sees complete ones.

The `engine` argument of save/load is either a `deepspeed.DeepSpeedEngine` (saved with its collective
`save_checkpoint` / `load_checkpoint`: every rank must call save/load) or a `TorchBundle(model,
optimizer, scheduler)` for plain single-process torch training (rank 0 writes it).
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import distributed as dist_utils
from .atomic import TMP_PREFIX, fsync_dir, fsync_tree, publish
from .checkpoint_manifest import build_manifest, newest_intact, require_intact, sealed_json

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d+)$")
TRASH_PREFIX = ".trash-"
DEEPSPEED_TAG = "engine"
HF_DIR = "hf"


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
    raise TypeError(f"engine must be a deepspeed.DeepSpeedEngine or an erpo.checkpoint.TorchBundle, "
                    f"got {type(engine).__name__}")


# ----------------------------------------------------------------------------------------------- RNG

def capture_rng_state() -> dict:
    """Python, numpy, torch CPU and (when available) every CUDA device's RNG state, as plain tensors."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state`."""
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state((np_state["name"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    `directory`: DeepSpeed's own collective save, or rank 0's torch.save of the TorchBundle's parts."""
    if kind == "deepspeed":
        engine.save_checkpoint(str(directory), tag=DEEPSPEED_TAG, client_state={}, save_latest=False,
                               exclude_frozen_parameters=bool(parameter_names(engine.module, trainable=False)))
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
    `before_commit`: optional callable run on rank 0 after every file of a checkpoint is written and
    before the commit rename (tests use it to kill a process mid-save).
    """

    def __init__(self, output_dir: str | os.PathLike, keep_last: int | None = 3):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                      or keep_last < 1):
            raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        root = Path(output_dir)
        self.root = root if root.name == "checkpoints" else root / "checkpoints"
        self.keep_last = keep_last
        self.before_commit: Callable[[], None] | None = None

    # -- discovery
    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = STEP_DIR.match(child.name)
            if match and child.is_dir() and (child / "meta.json").is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

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
        if dist_utils.is_main():
            self.root.mkdir(parents=True, exist_ok=True)
            self.remove_stale()
            tmp.mkdir()
            (tmp / "rng").mkdir()
        dist_utils.barrier()

        torch.save(capture_rng_state(), tmp / "rng" / f"rank-{dist_utils.rank()}.pt")
        write_training_state(engine, kind, tmp)
        if export:
            export_hf(engine if kind == "deepspeed" else engine.model, tokenizer, tmp / HF_DIR)
        dist_utils.barrier()
        files = build_manifest(tmp)   # collective: every rank digests a share

        if dist_utils.is_main():
            meta = {"format_version": FORMAT_VERSION, "step": step, "world_size": dist_utils.world_size(),
                    "engine": kind, "state": json.loads(state_json),
                    "trainable_parameters": parameter_names(trained_model(engine), trainable=True), "files": files}
            (tmp / "meta.json").write_text(sealed_json(meta))
            fsync_tree(tmp)
            if self.before_commit is not None:
                self.before_commit()
            if final.exists():  # an incomplete directory under the final name (not written by this class)
                remove_tree(final)
            tmp.rename(final)
            fsync_dir(self.root)
            self.prune()
        dist_utils.barrier()
        return str(final)

    def remove_stale(self) -> None:
        """Delete leftovers of interrupted saves and deletions (rank 0, before a save)."""
        for child in self.root.iterdir():
            if child.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and child.is_dir():
                shutil.rmtree(child)

    def prune(self) -> None:
        """Keep only the newest `keep_last` complete checkpoints."""
        if self.keep_last is None:
            return
        for _, path in self.complete_checkpoints()[:-self.keep_last]:
            remove_tree(path)

    # -- load
    def load(self, engine: Any, path: str | os.PathLike | None = None) -> dict:
        """Restore `engine` and this rank's RNG states from `path` (default: the newest checkpoint whose files are
        intact, `erpo.checkpoint_manifest.newest_intact`); collective under DeepSpeed. Returns the saved `state`
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


# ------------------------------------------------------------------------------------- graceful stop

class GracefulStop:
    """Turns SIGTERM (by default) into a request to stop after the current step.

    Usage:
        with GracefulStop() as stop:
            for step in ...:
                train_step()
                if stop.should_stop():          # collective: every rank, same place, every step
                    manager.save(step, engine, state); break

    `.requested` is True once a signal arrived on this rank. A second signal of the same kind gets the
    previous handler (by default: terminate at once). Install from the main thread.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)):
        self.signals = tuple(signals)
        if not self.signals:
            raise ValueError("signals must name at least one signal")
        self.requested = False
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def handle(self, signum, frame) -> None:
        self.requested = True
        self.received = signum
        logger.warning("received %s: finishing the current step, saving a checkpoint, then exiting",
                       signal.Signals(signum).name)
        signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))

    def install(self) -> "GracefulStop":
        for signum in self.signals:
            self.previous[signum] = signal.signal(signum, self.handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()

    def __enter__(self) -> "GracefulStop":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def should_stop(self) -> bool:
        """True on every rank when any rank was signalled (all-reduced, so ranks stop at the same step)."""
        return bool(dist_utils.all_reduce_sum(int(self.requested)))


# -------------------------------------------------------------------------------------------- export

def trained_model(engine: Any) -> torch.nn.Module:
    """The model a DeepSpeed engine or a TorchBundle holds."""
    return engine.module if engine_kind(engine) == "deepspeed" else engine.model


def parameter_names(model: torch.nn.Module, *, trainable: bool) -> list[str]:
    """Sorted state-dict names (tied names included) of `model`'s trainable or of its frozen parameters. Frozen
    ones (a LoRA model's base weights) are what checkpoints leave out."""
    return sorted(name for name, param in model.named_parameters(remove_duplicate=False)
                  if param.requires_grad == trainable)


def unwrap_model(model: Any) -> torch.nn.Module:
    """The underlying transformers model of a DeepSpeed engine, DDP wrapper or torch.compile'd module."""
    while True:
        if dist_utils.is_deepspeed_engine(model) or isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Full CPU state dict on rank 0 (None on other ranks), gathering ZeRO-3 partitioned parameters one
    at a time so no rank ever holds more than one whole parameter beyond its shard. Collective."""
    tensors = model.state_dict(keep_vars=True)
    copies: dict[int, torch.Tensor] = {}
    result: dict[str, torch.Tensor] | None = {} if dist_utils.is_main() else None
    for name, tensor in tensors.items():
        key = id(tensor)
        if key not in copies:
            with dist_utils.gathered([tensor]):
                copies[key] = tensor.detach().to("cpu", copy=True) if result is not None else None
        if result is not None:
            result[name] = copies[key]
    return result


def export_hf(model: Any, tokenizer: Any, out_dir: str | os.PathLike) -> str:
    """Write `model` (+ `tokenizer` when not None) with `save_pretrained` (safetensors) into `out_dir`,
    loadable by `transformers.AutoModelForCausalLM.from_pretrained` and by vLLM; a LoRA model's adapters alone
    (`erpo.lora.export_adapter`). Collective under DeepSpeed (ZeRO-3 parameters are gathered one by one); rank 0
    writes. Atomic: written to a sibling temporary directory, then renamed over `out_dir`. Returns out_dir.
    """
    from erpo.lora import export_adapter, is_lora_model   # erpo.lora builds on this module

    module = unwrap_model(model)
    if is_lora_model(module):
        return export_adapter(model, tokenizer, out_dir)
    if not hasattr(module, "save_pretrained"):
        raise TypeError(f"model must be a transformers PreTrainedModel (or wrap one), got {type(module).__name__}")
    return save_pretrained_atomically(module, gathered_state_dict(module), tokenizer, out_dir)


def save_pretrained_atomically(model, state_dict: dict | None, tokenizer, out_dir: str | os.PathLike,
                               **save_kwargs) -> str:
    """`model.save_pretrained(state_dict=...)` (a transformers or PEFT model; safetensors) and the tokenizer, if
    any, into `out_dir`, published by `write_dir_atomically`. Returns out_dir."""
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return write_dir_atomically(out_dir, write)


def is_hf_export(path: str | os.PathLike) -> bool:
    """Whether `path` holds an `export_hf` result: a model (config.json) or LoRA adapters (adapter_config.json)."""
    from erpo.lora import is_adapter_dir

    return (Path(path) / "config.json").is_file() or is_adapter_dir(path)


def publish_hf(export_dir: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Make `out_dir` hold the same files as the Hugging Face export `export_dir` (a checkpoint's `hf/`) without a
    second gather or a second copy on disk: each file is a hard link, or a copy where the file system has no
    links. Pruning the checkpoint later leaves `out_dir` whole. Rank 0 writes; atomic like `export_hf`; a
    collective barrier. Returns out_dir."""
    source = Path(export_dir)
    if dist_utils.is_main() and not is_hf_export(source):
        raise FileNotFoundError(f"{source} is not a Hugging Face export (no config.json or adapter_config.json)")

    def write(tmp: Path) -> None:
        shutil.copytree(source, tmp, copy_function=link_or_copy)
    return write_dir_atomically(out_dir, write)


def link_or_copy(source: str, target: str) -> None:
    """Hard-link `source` to `target`; copy it (with metadata) where linking is refused (other device, no links)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def write_dir_atomically(out_dir: str | os.PathLike, write: Callable[[Path], None]) -> str:
    """Rank 0 publishes `out_dir` with `erpo.atomic.publish` (`write(tmp)` fills a temporary directory unique to
    this call, which replaces `out_dir` in one rename: concurrent exports to one place never mix, a crash leaves
    the old `out_dir` or the new one); then every rank meets at a barrier."""
    if dist_utils.is_main():
        publish(out_dir, write)
    dist_utils.barrier()
    return str(out_dir)
