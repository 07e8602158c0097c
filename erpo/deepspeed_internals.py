"""DeepSpeed's private internals that erpo relies on, all here, checked against the DeepSpeed versions in
CHECKED_VERSIONS (the test extra installs one of them; tests/distributed and tests/train/test_checkpoint*.py exercise
each use). A DeepSpeed release that moves one breaks only this module:

- `deepspeed.utils.groups._WORLD_GROUP` / `_DATA_PARALLEL_GROUP`: DeepSpeed's cached copies of the world group,
  dropped when erpo destroys the process group (`forget_process_groups`);
- `DeepSpeedEngine.checkpoint_engine` and `DeepSpeedEngine._copy_recovery_script`: the writers of
  `save_checkpoint`, wrapped for one save so that a rank's failed write is raised after DeepSpeed's last barrier
  (`held_back_writes`);
- the `ds_id` attribute of a ZeRO-3 partitioned parameter (`is_partitioned`);
- on a machine without CUDA, the ops that DeepSpeed JIT-builds (its builders' names and compatibility, torch's
  private `_get_build_directory`), announced before the builds (`announce_cpu_builds`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

CHECKED_VERSIONS = ("0.19.8",)
# the ops DeepSpeed JIT-builds in a CPU run of the trainer (its builders' class names): the comm layer's, AdamW's
CPU_BUILT_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder")
# a build lock older than this is taken for one a killed build left (a build takes 1-3 minutes on a loaded 2-core CPU)
STALE_BUILD_LOCK_S = 600

log = logging.getLogger("erpo")


def announce_cpu_builds() -> None:
    """On a machine without CUDA, DeepSpeed JIT-builds two ops the first time it runs: its comm layer's shared-memory
    op (`deepspeed.init_distributed`, which ZeRO-3's partitioned model creation and `deepspeed.initialize` call) and
    its AdamW's fused_adam, into TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions by default): 1-3 minutes with no
    output, and waiting without a message on a build's lock file, forever where a build killed midway left it. Say
    so first: one info line naming the ops not built yet, one warning per lock older than STALE_BUILD_LOCK_S. Nothing
    on CUDA, or where DeepSpeed or torch moved what this reads (the builds themselves are DeepSpeed's either way)."""
    import torch
    if torch.cuda.is_available():
        return
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops import __compatible_ops__
        from torch.utils.cpp_extension import _get_build_directory
        builders = [get_accelerator().create_op_builder(name) for name in CPU_BUILT_OPS]
        folders = {builder.NAME: _get_build_directory(builder.NAME, verbose=False) for builder in builders
                   if builder is not None and __compatible_ops__.get(builder.NAME, False)}
    except (ImportError, AttributeError, TypeError, OSError):
        return
    unbuilt = []
    for name, folder in folders.items():
        lock = os.path.join(folder, "lock")
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_BUILD_LOCK_S:
            minutes = (time.time() - os.path.getmtime(lock)) / 60
            log.warning("DeepSpeed waits for %s (%.0f min old) before it builds its op %s: if no other run is "
                        "building it, a killed build left it; delete it", lock, minutes, name)
        elif not os.path.exists(os.path.join(folder, f"{name}.so")):
            unbuilt.append(name)
    if unbuilt:
        log.info("DeepSpeed builds its CPU ops %s once, into %s (1-3 minutes, no output)", " and ".join(unbuilt),
                 os.path.dirname(folders[unbuilt[0]]))


def forget_process_groups() -> None:
    """Drop DeepSpeed's cached copies of the world group (only when DeepSpeed was used in this process), so that a
    later engine in the same process is built on the new group instead of a destroyed one."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        groups._WORLD_GROUP = None
        groups._DATA_PARALLEL_GROUP = None


def is_partitioned(param: Any) -> bool:
    """True when `param` is partitioned by DeepSpeed ZeRO-3 (it carries a `ds_id`)."""
    return hasattr(param, "ds_id")


class HeldBackWrites:
    """Stands in for a DeepSpeed engine's `checkpoint_engine` during one save: its first failed write (makedirs or
    save, or any write run through `held_back`) is kept, not raised, and later writes are skipped, so this rank still
    runs every barrier of DeepSpeed's `save_checkpoint` with the others; `raise_failure()` raises it once DeepSpeed's
    save has returned."""

    def __init__(self, writer: Any):
        self.writer = writer
        self.failure: Exception | None = None

    def __getattr__(self, name: str) -> Any:   # create, commit, ...: DeepSpeed's own
        return getattr(self.writer, name)

    def held_back(self, write: Callable, *args, **kwargs) -> None:
        if self.failure is None:
            try:
                write(*args, **kwargs)
            except Exception as exc:   # a bug too: raised after the barriers, with its traceback
                self.failure = exc

    def makedirs(self, *args, **kwargs) -> None:
        self.held_back(self.writer.makedirs, *args, **kwargs)

    def save(self, *args, **kwargs) -> None:
        self.held_back(self.writer.save, *args, **kwargs)

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure


@contextlib.contextmanager
def held_back_writes(engine: Any) -> Iterator[HeldBackWrites]:
    """During one `engine.save_checkpoint`: the engine's checkpoint writer, and rank 0's copy of DeepSpeed's
    zero_to_fp32.py (written without the checkpoint engine), go through one `HeldBackWrites`; restored after."""
    writes = HeldBackWrites(engine.checkpoint_engine)
    engine.checkpoint_engine = writes
    copy_scripts: Callable | None = getattr(engine, "_copy_recovery_script", None)
    if copy_scripts is not None:
        engine._copy_recovery_script = lambda *args: writes.held_back(copy_scripts, *args)
    try:
        yield writes
    finally:
        engine.checkpoint_engine = writes.writer
        vars(engine).pop("_copy_recovery_script", None)
