"""What a training run changes for the whole process, put back when it ends: `left_as_found`.

A notebook or a script that calls `train()` and then computes or launches something else must find the process as it
was: the same `torch.nn.functional.linear`, the same CPU threads, no launcher variables and no process group of the
run's own one-process world.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import torch

from erpo import distributed as D


@contextlib.contextmanager
def variables_as_found(names: Iterable[str]):
    """Inside, anything; on leaving (return or raise), the environment variables `names` as they were on entering:
    set to the same values, or unset. Usable as a decorator."""
    before = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def left_as_found():
    """Inside, a training run; on leaving it (return or raise), what it changed for the whole process as it was on
    entering:

    - `torch.nn.functional.linear`: DeepSpeed ZeRO-3 (`zero.Init`, `deepspeed.initialize` at stage 3) replaces it with
      its memory-efficient linear and never puts it back; every nn.Linear of every model in the process would then
      compute with other roundings (a bf16 forward under autocast differs in the last bits), so a reference cache or
      an evaluation scored in the process after a ZeRO-3 run would not be what a fresh process scores;
    - torch's CPU threads (`torch.get_num_threads()`), which the run sets to `trainer.cpu_threads`;
    - the launcher variables (`D.LAUNCHER_VARIABLES`): those the run filled for a world of one process
      (`D.set_launcher_env`, for DeepSpeed or vLLM) are removed, so that a process launched later (`erpo train`,
      torchrun) does not inherit a MASTER_PORT this process had bound (EADDRINUSE); those the caller had set keep the
      caller's values;
    - a process group the run created for a world of one process (DeepSpeed's, on those variables) is destroyed with
      them (`D.destroy_distributed`): a later DeepSpeed engine in the process would find the group without its
      variables. The group of a launcher's world (WORLD_SIZE > 1, torchrun) stays for the rest of the script, as
      accelerate keeps it (`D.destroy_distributed()` ends it, as `erpo train` does before it exits).

    Kept on purpose: the seeds of Python, NumPy and torch (the run's `trainer.seed`, left as transformers' `set_seed`
    leaves them), and what a library sets once at its import (DeepSpeed's PYTORCH_NVML_BASED_CUDA_CHECK): the module
    stays imported. Usable as a decorator."""
    linear = torch.nn.functional.linear
    threads = torch.get_num_threads()
    own_world = not D.is_initialized() and not D.launched_distributed()
    try:
        with variables_as_found(D.LAUNCHER_VARIABLES):
            yield
    finally:
        if own_world:
            D.destroy_distributed()
        torch.nn.functional.linear = linear
        torch.set_num_threads(threads)
