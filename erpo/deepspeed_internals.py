"""DeepSpeed's private internals that erpo relies on, all here, checked against the DeepSpeed versions in
CHECKED_VERSIONS (the test extra installs one of them; tests/distributed and tests/train/test_checkpoint*.py exercise
each use). A DeepSpeed release that moves one breaks only this module:

- `deepspeed.utils.groups._WORLD_GROUP` / `_DATA_PARALLEL_GROUP`: DeepSpeed's cached copies of the world group,
  dropped when erpo destroys the process group (`forget_process_groups`);
- `DeepSpeedEngine.checkpoint_engine` and `DeepSpeedEngine._copy_recovery_script`: the writers of
  `save_checkpoint`, wrapped for one save so that a rank's failed write is raised after DeepSpeed's last barrier
  (`held_back_writes`);
- the `ds_id` attribute of a ZeRO-3 partitioned parameter (`is_partitioned`);
- on a machine without CUDA, `deepspeed.ops.__compatible_ops__` (the op compatibility DeepSpeed's comm layer reads
  before it JIT-builds its shared-memory op), where erpo marks that op not compatible (`skip_cpu_shm_op`).
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

CHECKED_VERSIONS = ("0.19.8",)


def skip_cpu_shm_op() -> None:
    """On a machine without CUDA, keep DeepSpeed's comm layer from JIT-building its shared-memory op.

    Why: `deepspeed.init_distributed` (which ZeRO-3's partitioned model creation and `deepspeed.initialize` call)
    creates `deepspeed.comm.torch.TorchBackend`, whose `build_shm_op()` compiles ShareMemCommBuilder's C++ op
    (`deepspeed_shm_comm`) into TORCH_EXTENSIONS_DIR: minutes of CPU, and a C++ compiler on the user's machine. The op
    serves only `inference_all_reduce` (AutoTP inference layers), which without it runs torch.distributed.all_reduce;
    training never calls it. What it changes: the op's entry in DeepSpeed's `deepspeed.ops.__compatible_ops__` is set
    to False, and `build_shm_op` skips an op that is not compatible. Call it before DeepSpeed's comm layer is created
    (a later call changes nothing). Nothing on CUDA; where DeepSpeed moved what this reads, nothing either (DeepSpeed
    then builds the op, as it would without erpo)."""
    import torch
    if torch.cuda.is_available():
        return
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        compatible = deepspeed.ops.__compatible_ops__
    except (ImportError, AttributeError, TypeError):
        return
    if builder is not None and isinstance(compatible, dict):
        compatible[builder.NAME] = False


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
