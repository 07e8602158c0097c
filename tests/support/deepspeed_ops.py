"""DeepSpeed's CPU ops (erpo.deepspeed_internals.CPU_BUILT_OPS), built before the tests that launch ranks: the first
DeepSpeed job of a session JIT-builds them (1-3 minutes, much more on a loaded machine), which would otherwise count
against that test's own limit for its ranks."""
import os
import sys

from paths import worker_pythonpath
from process_group import run_group

# as DeepSpeed's comm layer does (deepspeed.comm.torch.build_shm_op): an op that is not compatible here is not built
BUILD = """
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
from erpo.deepspeed_internals import CPU_BUILT_OPS
for name in CPU_BUILT_OPS:
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load()
"""
BUILD_LIMIT_S = 1800  # a hung build only: two ops, 1-3 minutes each on an idle 2-core CPU


def build_cpu_ops() -> None:
    """Build (or find built) DeepSpeed's CPU ops in TORCH_EXTENSIONS_DIR (tests/conftest.py: one folder per session,
    every worker's; torch's build lock makes a second builder wait for the first), in a process of its own as the
    ranks do: DS_ACCELERATOR=cpu, no CUDA device."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=worker_pythonpath())
    done = run_group([sys.executable, "-c", BUILD], env, BUILD_LIMIT_S)   # a hung build's compilers go with it
    assert done.returncode == 0, f"DeepSpeed's CPU ops did not build:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
