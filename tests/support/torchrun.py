"""A test worker under torchrun on CPU processes (gloo, DeepSpeed's CPU accelerator): a free port, the launch,
rank 0's results, and the worker's exit."""
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from paths import worker_pythonpath
from process_group import run_group

# The limit of one multi-rank job of a test (a hung job only): on the 2-core CPU a 2-rank job takes 20-60 s alone, and
# several times that beside another pytest-xdist worker and other jobs on the machine (docs/CONTRIBUTING.md)
RANKS_LIMIT_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_worker(worker: Path, out: Path, *args: str, nproc: int = 2) -> dict:
    """Run `worker` (with `args` and `--out out`) under torchrun with `nproc` CPU processes; the results rank 0
    saved to `out` (torch.load). A failed worker fails the test with the end of its output; on the limit, its ranks
    are killed with torchrun (process_group)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(worker), *args, "--out", str(out)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=worker_pythonpath())
    proc = run_group(cmd, env, RANKS_LIMIT_S)
    assert proc.returncode == 0, f"worker failed ({' '.join(cmd)}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return torch.load(out, weights_only=True)


def finish_worker(result, out: str) -> None:
    """End a worker: rank 0 saves `result` to `out` (what `run_worker` loads), every rank waits at a barrier for it,
    then exits without the interpreter's teardown: there, about 1 run in 10 of a gloo worker aborted ("terminate
    called without an active exception") after every result was written, which failed the test."""
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
