"""The processes the suite launches run Triton's interpreter as the suite's own process does: patched once per kernel
launch (interpreter_patch_once.py, which tests/conftest.py applies in-process). Python imports this module at start-up
from the folder `paths.worker_pythonpath()` puts on PYTHONPATH; it patches only where TRITON_INTERPRET=1 (the
kernels compute the same values either way) and touches nothing else."""
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from types import SimpleNamespace

    from interpreter_patch_once import patch_lang_once_per_launch

    patch_lang_once_per_launch(SimpleNamespace(setattr=setattr))  # for the process's life: no undo needed
