"""The process-wide state a test file must leave as it found it (tests/conftest.py checks it around every file): a
pytest-xdist worker runs many files in one process, and a function, method or switch that one file leaves replaced
changes what the next files compute. Once, DeepSpeed ZeRO-3's `torch.nn.functional.linear` (left by an in-process
`erpo train` at ZeRO-3) changed the last bits of tests/integrations/test_verl_fused_kernels.py's bf16 forwards.

Watched: torch.nn.functional's and torch's functions, the methods of torch.Tensor and torch.nn.Module, transformers'
attention registry, torch's numeric switches. A name a file adds is not a change (DeepSpeed's `zero.Init` leaves
its `_old_init` on nn.Module, unused), nor the inherited method put back into a class's own dict (its
`nn.Module.__init_subclass__`); a watched name whose object is another one, or gone, is.

And the whole environment (`os.environ`), where a variable a file adds is a change too: the next files, and every
process they launch, read it. Once, an in-process `erpo train` left MASTER_PORT set, and a later file's child `erpo
train` bound the port again (EADDRINUSE); verl's engine import left TORCH_CUDA_ARCH_LIST=8.0 for every later build.
All of it rather than a list of the variables known to matter: what a leak changes is not known in advance. Not
watched (`LIBRARY_VARIABLES`): pytest's own PYTEST_CURRENT_TEST, and what a library sets once for the rest of the
process on its first use, wherever that falls in the suite."""
import os
import sys

import torch
from torch._dynamo.mutation_guard import install_generation_tagging_init

MISSING = object()
# set by pytest for each test's phase, and by a library once for the rest of the process on its first use
LIBRARY_VARIABLES = {
    "PYTEST_CURRENT_TEST": "pytest: the running test and phase",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "`import deepspeed` (setdefault: torch's CUDA check through NVML)",
    "TORCHINDUCTOR_CACHE_DIR": "torch.compile's first compilation: where Inductor caches, made absolute",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "torch.compile's first compilation: Inductor's own bookkeeping",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "`import verl` (setdefault)",
    "VLLM_LOGGING_LEVEL": "`import trl` where vLLM is installed (its default kept: setdefault in effect)",
}
# What torch does once per process, before any file's snapshot: importing torch._dynamo (above) wraps
# torch.manual_seed, and the first torch.compile patches nn.Module.__init__ / __setstate__ (this call)
install_generation_tagging_init()


def class_members(cls: type) -> dict:
    """{name: `getattr(cls, name)`} of the names `dir(cls)` lists: what a call through the class finds (a name put
    back into the class's own dict as the method it inherits, bound as before, is the same member)."""
    members = {}
    for name in dir(cls):
        try:
            members[name] = getattr(cls, name)
        except AttributeError:
            continue
    return members


def torch_switches() -> dict:
    """torch's process-wide numeric switches: threads, matmul precision, determinism, oneDNN, SDPA backends, default
    dtype, grad / inference / autocast modes, the torch-function and dispatch mode stacks."""
    matmul = torch.backends.cuda.matmul
    return {
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
        "torch.backends.mkldnn.enabled": torch.backends.mkldnn.enabled,
        "torch.backends.cuda.{flash,math,mem_efficient,cudnn}_sdp_enabled()": (
            torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()),
        "torch.backends.cuda.matmul.allow_{tf32,bf16,fp16}_reduced_precision": (
            matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction),
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
        "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
        "torch.is_autocast_enabled('cpu')": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "torch function / dispatch modes": (torch._C._len_torch_function_stack(),
                                            torch._C._len_torch_dispatch_stack()),
    }


def process_globals() -> dict[str, dict]:
    """{watched namespace: {name: object or value}} of this process now."""
    state = {
        "torch.nn.functional": {name: value for name, value in vars(torch.nn.functional).items() if callable(value)},
        "torch": {name: value for name, value in vars(torch).items() if callable(value)},
        "torch.Tensor": class_members(torch.Tensor),
        "torch.nn.Module": class_members(torch.nn.Module),
        "switches": torch_switches(),
    }
    state["os.environ"] = {name: value for name, value in os.environ.items() if name not in LIBRARY_VARIABLES}
    modeling_utils = sys.modules.get("transformers.modeling_utils")   # only once a file has imported transformers
    if modeling_utils is not None:
        registry = modeling_utils.ALL_ATTENTION_FUNCTIONS
        state["transformers ALL_ATTENTION_FUNCTIONS"] = {name: registry[name] for name in registry.keys()}
    return state


def changed_globals(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """'namespace.name: before -> after' for each watched name of `before` that `after` holds as another object
    or value (`same_object`), or no longer holds, and for each environment variable `after` adds. A namespace
    `before` lacks is skipped."""
    changes = []
    for space, names in before.items():
        now = after.get(space, {})
        added = [name for name in now if name not in names] if space == "os.environ" else []
        for name in [*names, *added]:
            value, current = names.get(name, MISSING), now.get(name, MISSING)
            if not same_object(current, value):
                changes.append(f"{space}.{name}: {describe(value)} -> {describe(current)}")
    return changes


def same_object(a, b) -> bool:
    """`a` is `b`, or equal to it: a method bound anew to the same object and function, a switch's value."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:   # an object whose == is not a truth value
        return False


def describe(value) -> str:
    """A function as module.qualname, anything else as its repr."""
    if value is MISSING:
        return "(none)"
    name = getattr(value, "__qualname__", None)
    return f"{getattr(value, '__module__', None) or '?'}.{name}" if name else repr(value)
