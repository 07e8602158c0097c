"""A process a test launches with `paths.worker_pythonpath()` runs Triton's interpreter as the suite's own process
does, patched once per launch (tests/support/interpreter_site/sitecustomize.py, interpreter_patch_once.py), and gets
the same values as the unpatched interpreter; without TRITON_INTERPRET=1 nothing is patched."""
import json
import os
import subprocess
import sys

from paths import REPO, worker_pythonpath

# a kernel that calls a device function in each program (where the patch skips the language's second patching)
CHILD = """
import json

import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interpreter

@triton.jit
def affine(x):
    return x * 2.0 + tl.exp(x)

@triton.jit
def kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, affine(tl.load(x_ptr + offsets)))

x = torch.linspace(-3, 3, 64)
out = torch.empty_like(x)
kernel[(4,)](x, out, BLOCK=16)
print(json.dumps({"launch": interpreter.GridExecutor.__call__.__name__, "out": out.tolist()}))
"""


def child(command: list, pythonpath: str, interpret: bool) -> str:
    """The last line `python *command` prints, run with PYTHONPATH `pythonpath`, TRITON_INTERPRET=1 if `interpret`."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, *command], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return done.stdout.splitlines()[-1]


def test_launched_processes_run_the_interpreter_patched_once_per_launch_with_the_same_values(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    patched = json.loads(child([str(script)], worker_pythonpath(), interpret=True))
    plain = json.loads(child([str(script)], str(REPO), interpret=True))
    assert patched["launch"] == "patched_launch" and plain["launch"] == "__call__"
    assert patched["out"] == plain["out"]
    # compiled Triton (no TRITON_INTERPRET): nothing patched
    assert child(["-c", "import triton.runtime.interpreter as i; print(i.GridExecutor.__call__.__name__)"],
                 worker_pythonpath(), interpret=False) == "__call__"
