"""What one logits-path loss call costs the host, phase by phase, with no kernel running: microseconds of Python,
dispatch and allocation per fwd+bwd, for erpo_loss and for Liger's triton_grpo_loss on the same problem.

    python -m bench.host_cost                       # N=1024 rows, V=128, 200 calls each; a markdown table
    python -m bench.host_cost --n 4096 --reps 500 --json out.json
    python -m bench.host_cost --device cuda --n 4096   # on a GPU: compiled kernels, real launches (below)
    python -m bench.host_cost --path fused          # the fused path, phase by phase and per chunk (host_cost_fused)

Every Triton launch is stubbed out (the interpreter's launcher `run` returns at once and counts the launch), the
tensors live on the CPU, and each call is timed with `time.perf_counter_ns`. What is left is the host's own work:
argument checks, option parsing, custom-op and autograd dispatch, allocations, the aten operators (run for real on
tiny CPU tensors: their CPU time stands in for a CUDA launch's host time, which is larger) and the host read of the
validation result (no wait here: nothing is queued). Triton's own launch path is not in those rows: the table counts
the Triton launches per call, and times apart the part of a compiled launch a CPU can run ("Triton launch binding,
CUDA sm_90"): what Triton 3.6's `JITFunction.run` does on the host before the driver, on the call's own arguments,
with the binder Triton builds for a CUDA target (`create_function_from_signature` with `make_backend(GPUTarget("cuda",
90, 32))`: `native_specialize_impl` on every argument, the options dict, `compute_cache_key`, the kernel cache's
lookup). The step after it, the check of the kernel's global values (each module-level `tl.constexpr` the kernel
and its jit functions read, compared with its value at compile time on every launch), is timed apart ("Triton
global-value checks"): `bench.kernel_globals`, in a process of its own without the interpreter, finds them as Triton
does. It cannot count what needs a GPU: the driver's current device and stream and the C launcher (per pointer
argument a `data_ptr()` call and a `cuPointerGetAttribute`, then `cuLaunchKernelEx`). On a GPU the host time
before the first big kernel and after the last one adds to the measured call; the rest overlaps the kernels only
when no host read stands between them.

Phases are measured by wrapping functions of each contender (PHASES: the module attributes the loss calls through);
"entry" is the call's time outside every wrapped phase. The machine is shared: read medians, not single calls.

`--device cuda` times the same phases on a GPU machine with nothing stubbed: compiled Triton kernels, CUDA aten
operators, the driver's launches, all at the small V (the kernels take microseconds, so each phase is the host's time,
its launch paths included, but for the validation read's short wait, in "entry"). The device is synchronized
before each call, outside the clock. There, the launch count and the binding row are not measured (shown as "-").
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from .provenance import provenance

# contender -> [(phase, module, attribute)]: the functions whose time is that phase's (each call of the loss goes
# through them by these module-level names)
PHASES = {
    "erpo": [("validation", "erpo_kernels.api", "start_loss_input_checks"),
             ("loss node (kernels queued, metrics)", "erpo_kernels.api", "triton_logits_loss")],
    "liger": [],
}
BACKWARD = "autograd backward"


BINDING = "Triton launch binding, CUDA sm_90 (not in total)"
GLOBALS = "Triton global-value checks (not in total)"


class StubbedTriton:
    """Within the block, every Triton launch (interpreted) returns at once; `launches` counts them and `recorded`
    keeps the latest call's (kernel, args, kwargs), cleared by `record_next_call`."""

    def __init__(self):
        self.launches = 0
        self.launches_per_call = None   # set by `_phase_medians`
        self.recorded = []

    def record_next_call(self):
        self.recorded = []

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        self._original = InterpretedFunction.run
        stub = self

        def run(kernel, *args, grid, warmup, **kwargs):
            stub.launches += 1
            stub.recorded.append((kernel, args, kwargs))
        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction
        InterpretedFunction.run = self._original


class CudaBinding:
    """The host part of a compiled Triton 3.6 launch that runs without a GPU (module docstring), for kernels defined
    under the interpreter: `time_us(kernel, args, kwargs, reps)` is the median microseconds of `JITFunction.run`'s
    steps from its option keywords to the kernel cache's lookup, with the binder Triton builds for an sm_90 target."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binders = {}   # interpreted kernel -> (binder, kernel key cache, number of parameters)

    def binder(self, kernel):
        if kernel not in self.binders:
            from triton.runtime.jit import JITFunction, create_function_from_signature
            compiled = JITFunction(kernel.fn, **kernel.kwargs)
            self.binders[kernel] = (create_function_from_signature(compiled.signature, compiled.params, self.backend),
                                    {}, len(compiled.params))
        return self.binders[kernel]

    def time_us(self, kernel, args, kwargs, reps: int) -> float:
        from triton import knobs
        from triton.runtime.jit import compute_cache_key
        binder, key_cache, _ = self.binder(kernel)
        kernel_cache = {}
        samples = []
        for _ in range(reps + 1):  # the first fills the key cache, as a kernel's first launch does
            begin = time.perf_counter_ns()
            options = dict(kwargs)   # JITFunction.run's own lines, up to the launch
            options["debug"] = options.get("debug", None) or knobs.runtime.debug
            options["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            bound_args, specialization, options = binder(*args, **options)
            kernel_cache.get(compute_cache_key(key_cache, specialization, options), None)
            tuple(bound_args.values())
            samples.append(time.perf_counter_ns() - begin)
        return statistics.median(samples[1:]) / 1e3


def binding_costs(recorded, checks: dict, reps: int) -> list:
    """[{"kernel", "parameters", "pointers", "us", "globals", "globals_us"}] for each launch of `recorded`
    (StubbedTriton's), in launch order: its tensor arguments (on CUDA the C launcher's `data_ptr()` and
    `cuPointerGetAttribute` each, not timed here), the binding's microseconds (`CudaBinding`), and the global values
    its compiled kernel checks on each launch with that check's microseconds (`checks`: `global_checks` of these
    launches' kernels, and maybe of others)."""
    binding = CudaBinding()
    return [{"kernel": kernel.fn.__name__, "parameters": binding.binder(kernel)[2],
             "pointers": sum(isinstance(value, torch.Tensor) for value in (*args, *kwargs.values())),
             "us": binding.time_us(kernel, args, kwargs, reps), "globals": len(checks[_reference(kernel)]["globals"]),
             "globals_us": checks[_reference(kernel)]["us"]} for kernel, args, kwargs in recorded]


def _reference(kernel) -> str:
    return f"{kernel.fn.__module__}:{kernel.fn.__name__}"


def global_checks(kernels, reps: int) -> dict:
    """`bench.kernel_globals.measure` of the interpreted `kernels`, run in a process without the interpreter."""
    references = sorted({_reference(kernel) for kernel in kernels})
    if not references:
        return {}
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "bench.kernel_globals", *references, "--reps", str(reps)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench.kernel_globals failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


@contextlib.contextmanager
def wrapped_attributes(targets, wrap):
    """Within the block each (phase, owner, attribute) of `targets` is wrap(phase, original), owner a module or a
    class (whose own attribute is taken, a staticmethod as such); restored on exit."""
    saved = []
    for phase, owner, attribute in targets:
        original = owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)
        saved.append((owner, attribute, original))
        setattr(owner, attribute, wrap(phase, original))
    try:
        yield
    finally:
        for owner, attribute, original in reversed(saved):
            setattr(owner, attribute, original)


def timed_phases(phases, spent: dict):
    """Wrap each (phase, module, attribute) so that its time (ns) adds to spent[phase]; restored on exit."""
    def wrap(phase, function):
        def timed(*args, **kwargs):
            begin = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter_ns() - begin
        return timed

    return wrapped_attributes([(phase, importlib.import_module(module), attribute)
                               for phase, module, attribute in phases], wrap)


def measure(prepared, phases, reps: int, warmup: int, device: torch.device = torch.device("cpu")) -> tuple:
    """(result, launches): median microseconds per call of each phase, "entry", BACKWARD and "total" (fwd+bwd) in
    result["us"] and the Triton launches per call, for `prepared` (bench.contenders.Prepared) with `phases` wrapped
    and Triton stubbed, and the last call's launches (StubbedTriton's `recorded`, for `add_binding`). On CUDA nothing
    is stubbed (module docstring): launches None."""
    if device.type == "cuda":
        return {"us": _phase_medians(prepared, phases, reps, warmup, device), "triton_launches": None}, None
    with StubbedTriton() as stub:
        us = _phase_medians(prepared, phases, reps, warmup, device, stub)
    return {"us": us, "triton_launches": stub.launches_per_call}, stub.recorded


def add_binding(result: dict, recorded, checks: dict, reps: int) -> None:
    """Into a CPU `measure` result: BINDING, the Triton launches' binding on a CUDA target, and GLOBALS, their
    compiled kernels' checks of global values (`binding_costs` on its `recorded` launches, with `checks` from
    `global_checks`: their sums in "us", each launch in "binding")."""
    binding = binding_costs(recorded, checks, reps)
    result["us"][BINDING] = sum(launch["us"] for launch in binding)
    result["us"][GLOBALS] = sum(launch["globals_us"] for launch in binding)
    result["binding"] = binding


def _phase_medians(prepared, phases, reps: int, warmup: int, device: torch.device, stub=None) -> dict:
    """{phase: median us} over `reps` timed fwd+bwd calls after `warmup`; `stub` (StubbedTriton) records the last
    call's launches and their count per timed call (`launches_per_call`)."""
    samples = defaultdict(list)
    launches_before = 0
    for rep in range(warmup + reps):
        if stub is not None:
            stub.record_next_call()
            if rep == warmup:
                launches_before = stub.launches
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        spent = defaultdict(int)
        with timed_phases(phases, spent):
            begin = time.perf_counter_ns()
            loss = prepared.run()
            forward_done = time.perf_counter_ns()
            torch.autograd.grad(loss, prepared.inputs)
            end = time.perf_counter_ns()
        if rep < warmup:
            continue
        spent["entry"] = (forward_done - begin) - sum(spent.values())
        spent[BACKWARD] = end - forward_done
        spent["total"] = end - begin
        for phase, ns in spent.items():
            samples[phase].append(ns / 1e3)
    if stub is not None:
        stub.launches_per_call = (stub.launches - launches_before) / reps
    order = ["entry"] + [phase for phase, _, _ in phases] + [BACKWARD, "total"]
    unused = [f"{module}.{attribute}" for phase, module, attribute in phases if not samples[phase]]
    if unused:
        raise RuntimeError(f"host_cost: the loss never called {', '.join(unused)}: PHASES names a stale path")
    return {phase: statistics.median(samples[phase]) for phase in order}


def build(num_rows: int, vocab: int, rows_per_sample: int, device: torch.device = torch.device("cpu")):
    from .contenders import ERPO_OPTIONS
    from .problem import Shape, build_problem
    return build_problem("logits", Shape(f"V={vocab}", 64, vocab), num_rows, rows_per_sample=rows_per_sample,
                         query_frac=0.25, dtype=torch.bfloat16, device=device, seed=0,
                         chunk_rows=num_rows, clip_low=ERPO_OPTIONS["clip_low"], clip_high=ERPO_OPTIONS["clip_high"])


def run(num_rows: int, vocab: int, rows_per_sample: int, reps: int, warmup: int, contenders=("erpo", "liger"),
        device: torch.device = torch.device("cpu")):
    """{contender: measure(...)'s result} on one problem, on the CPU with its launches' binding and global-value
    checks (`add_binding`; every contender's kernels in one `global_checks` process); a contender that is not
    installed maps to its reason."""
    from .contenders import CONTENDERS
    problem = build(num_rows, vocab, rows_per_sample, device)
    results, recorded = {}, {}
    for key in contenders:
        contender = next(c for c in CONTENDERS if c.key == key and c.path == "logits")
        missing = contender.requirement(device)
        if missing is not None:
            results[key] = f"{missing[0]}: {missing[1]}"
            continue
        results[key], launches = measure(contender.prepare(problem), PHASES[key], reps, warmup, device)
        if launches is not None:
            recorded[key] = launches
    checks = global_checks([kernel for launches in recorded.values() for kernel, _, _ in launches], reps)
    for key, launches in recorded.items():
        add_binding(results[key], launches, checks, reps)
    return results


def markdown(results: dict) -> str:
    """One column per contender, one row per phase (microseconds per call, medians)."""
    measured = {key: value for key, value in results.items() if isinstance(value, dict)}
    phases = []
    for value in measured.values():
        phases += [phase for phase in value["us"] if phase not in phases]
    phases = [phase for phase in phases if phase not in ("total", BINDING, GLOBALS)]
    lines = ["| phase (host us per fwd+bwd, median) | " + " | ".join(measured) + " |",
             "|---|" + "---|" * len(measured)]
    for phase in phases + ["total"]:
        cells = [f"{value['us'][phase]:.0f}" if phase in value["us"] else "-" for value in measured.values()]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines.append("| Triton launches per call | " + " | ".join(
        "-" if value["triton_launches"] is None else f"{value['triton_launches']:g}" for value in measured.values())
        + " |")
    for row in (BINDING, GLOBALS):
        lines.append(f"| {row} | " + " | ".join(
            f"{value['us'][row]:.0f}" if row in value["us"] else "-" for value in measured.values()) + " |")
    launches = [(key, launch) for key, value in measured.items() for launch in value.get("binding", ())]
    if launches:
        lines += ["", "| contender | kernel | parameters | pointers | binding us (CUDA sm_90) | globals | their check "
                      "us |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {key} | `{launch['kernel']}` | {launch['parameters']} | {launch['pointers']} | "
                  f"{launch['us']:.1f} | {launch['globals']} | {launch['globals_us']:.1f} |"
                  for key, launch in launches]
    for key, value in results.items():
        if not isinstance(value, dict):
            lines.append(f"\n{key}: {value}")
    return "\n".join(lines)


def use_interpreter(parser: argparse.ArgumentParser) -> None:
    """Set TRITON_INTERPRET=1 before triton is imported (the interpreter's launcher is the one stubbed); a parser
    error if triton was imported without it."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("triton was imported without TRITON_INTERPRET=1: run `python -m bench.host_cost` in a "
                     "process of its own")
    os.environ["TRITON_INTERPRET"] = "1"


def main(argv=None):
    command = sys.argv[1:] if argv is None else list(argv)  # the JSON's provenance: the command as given
    path = argparse.ArgumentParser(add_help=False)
    path.add_argument("--path", choices=("logits", "fused"), default="logits")
    known, argv = path.parse_known_args(command)
    if known.path == "fused":  # the fused path's own options and table: bench/host_cost_fused.py
        from .host_cost_fused import main as fused_main
        return fused_main(argv, command)
    parser = argparse.ArgumentParser(prog="python -m bench.host_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024, help="token rows N")
    parser.add_argument("--vocab", type=int, default=128, help="V (the kernels do not run: small is honest)")
    parser.add_argument("--rows-per-sample", type=int, default=256)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--contenders", default="erpo,liger")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    parser.add_argument("--commit", default=None, help="commit the JSON records (default: git rev-parse HEAD, if any)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: Triton stubbed under its interpreter; cuda: compiled kernels, nothing stubbed")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        use_interpreter(parser)
    elif os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU and compiled kernels (TRITON_INTERPRET unset)")
    torch.set_num_threads(1)
    results = run(args.n, args.vocab, args.rows_per_sample, args.reps, args.warmup,
                  [key.strip() for key in args.contenders.split(",") if key.strip()], torch.device(args.device))
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU, Triton stubbed"
    print(f"N={args.n}, V={args.vocab}, {args.reps} calls each (after {args.warmup}), torch {torch.__version__}, "
          f"{where}\n")
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"meta": provenance("bench.host_cost", command, args.commit), "args": vars(args),
                       "results": results}, file, indent=1)


if __name__ == "__main__":
    main()
