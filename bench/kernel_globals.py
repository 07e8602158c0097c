"""The check of a compiled Triton kernel's global values, per launch: what Triton 3.6's `JITFunction.run` does after
its kernel cache's lookup on every launch (for each module-level `tl.constexpr` the kernel and the jit functions it
calls read, a lookup and a `!=` of two constexpr objects, itself a constexpr made and its truth taken), and which
`bench.host_cost` adds to the binding row. Triton finds those globals (`used_global_vals`) with the kernel's cache
key, which the interpreter's kernels do not have: this module runs in a process of its own, without
TRITON_INTERPRET, and needs no GPU.

    python -m bench.kernel_globals MODULE:KERNEL ... --reps 300   # one JSON line: {"MODULE:KERNEL": {...}}
    python -m bench.kernel_globals erpo_kernels                    # every jit function of a package or module

Each kernel's globals are taken as Triton holds them once every jit function of the kernels' modules has its cache
key (a helper's globals join a kernel's only when the helper's key was made first: a process that has compiled
other kernels on the way, as a trainer's has).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import statistics
import time


def steady_globals(kernels: list) -> dict:
    """{kernel: [global name, ...]} for compiled-mode JITFunctions, every jit function of their modules keyed first
    (module docstring)."""
    from triton.runtime.jit import JITFunction
    modules = {importlib.import_module(kernel.fn.__module__) for kernel in kernels}
    for module in modules:
        for value in list(vars(module).values()):
            if isinstance(value, JITFunction):
                value.cache_key
    for kernel in kernels:  # again, now that their helpers' globals are known
        kernel.hash = None
        kernel.cache_key
    return {kernel: sorted(name for name, _ in kernel.used_global_vals) for kernel in kernels}


def check_us(kernel, reps: int) -> float:
    """Median microseconds of `JITFunction.run`'s check of `kernel`'s global values (its own lines)."""
    samples = []
    for _ in range(reps + 1):
        begin = time.perf_counter_ns()
        not_present = object()
        for (name, _), (val, globals_dict) in kernel.used_global_vals.items():
            if (new_val := globals_dict.get(name, not_present)) != val:
                raise RuntimeError(f"global {name} changed from {val} to {new_val}")
        samples.append(time.perf_counter_ns() - begin)
    return statistics.median(samples[1:]) / 1e3


def jit_functions(name: str) -> list:
    """["MODULE:FUNCTION", ...]: every @triton.jit function defined in module `name`, or in each module of package
    `name` (those a module imports from another are listed under their own module), in name order."""
    from triton.runtime.jit import JITFunction
    package = importlib.import_module(name)
    modules = [package] + [importlib.import_module(info.name)
                           for info in pkgutil.walk_packages(getattr(package, "__path__", []), f"{name}.")]
    return sorted(f"{module.__name__}:{attribute}" for module in modules
                  for attribute, value in vars(module).items()
                  if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__)


def measure(references: list, reps: int) -> dict:
    """{"MODULE:KERNEL": {"globals": [name, ...], "us": median check us}} for each reference; a reference without a
    ":" stands for every jit function of that module or package (`jit_functions`)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("bench.kernel_globals needs compiled-mode kernels: run it without TRITON_INTERPRET=1")
    kernels = {}
    for reference in [each for given in references for each in (jit_functions(given) if ":" not in given
                                                                  else [given])]:
        module, name = reference.split(":")
        kernels[reference] = getattr(importlib.import_module(module), name)
    names = steady_globals(list(kernels.values()))
    return {reference: {"globals": names[kernel], "us": check_us(kernel, reps)}
            for reference, kernel in kernels.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_globals", description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="+",
                        help="MODULE:KERNEL, a @triton.jit kernel, or MODULE / PACKAGE: each jit function in it")
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.kernels, args.reps)))


if __name__ == "__main__":
    main()
