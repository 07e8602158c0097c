"""What one logits-path loss call costs the host, phase by phase, with no kernel running: microseconds of Python,
dispatch and allocation per fwd+bwd, for erpo_loss and for Liger's triton_grpo_loss on the same problem.

    python -m bench.host_cost                       # N=1024 rows, V=128, 200 calls each; a markdown table
    python -m bench.host_cost --n 4096 --reps 500 --json out.json
    python -m bench.host_cost --path fused          # the fused path, phase by phase and per chunk (host_cost_fused)

Every Triton launch is stubbed out (the interpreter's launcher `run` returns at once and counts the launch), the
tensors live on the CPU, and each call is timed with `time.perf_counter_ns`. What is left is the host's own work:
argument checks, option parsing, custom-op and autograd dispatch, allocations, the aten operators (run for real on
tiny CPU tensors: their CPU time stands in for a CUDA launch's host time, which is larger) and the host read of the
validation result (no wait here: nothing is queued). Triton's own launch path (argument binding, the cache lookup,
the driver call: some microseconds per launch on a GPU machine) is not in the numbers: the table counts the Triton
launches per call instead. On a GPU the host time before the first big kernel and after the last one adds to the
measured call; the rest overlaps the kernels only when no host read stands between them.

Phases are measured by wrapping functions of each contender (PHASES: the module attributes the loss calls through);
"entry" is the call's time outside every wrapped phase. The machine is shared: read medians, not single calls.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import time
from collections import defaultdict

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the interpreter's launcher is the one stubbed

import torch  # noqa: E402

# contender -> [(phase, module, attribute)]: the functions whose time is that phase's (each call of the loss goes
# through them by these module-level names)
PHASES = {
    "erpo": [("validation", "erpo_kernels.api", "start_loss_input_checks"),
             ("forward launch", "erpo_kernels.api", "per_token_logp_entropy"),
             ("objective", "erpo_kernels.api", "objective_on_backend")],
    "liger": [],
}
BACKWARD = "autograd backward"


class StubbedTriton:
    """Within the block, every Triton launch (interpreted) returns at once; `launches` counts them."""

    def __init__(self):
        self.launches = 0

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        self._original = InterpretedFunction.run
        stub = self

        def run(kernel, *args, grid, warmup, **kwargs):
            stub.launches += 1
        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction
        InterpretedFunction.run = self._original


@contextlib.contextmanager
def timed_phases(phases, spent: dict):
    """Wrap each (phase, module, attribute) so that its time (ns) adds to spent[phase]; restored on exit."""
    saved = []

    def wrap(phase, function):
        def timed(*args, **kwargs):
            begin = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter_ns() - begin
        return timed

    for phase, module_name, attribute in phases:
        module = importlib.import_module(module_name)
        original = getattr(module, attribute)
        saved.append((module, attribute, original))
        setattr(module, attribute, wrap(phase, original))
    try:
        yield
    finally:
        for module, attribute, original in saved:
            setattr(module, attribute, original)


def measure(prepared, phases, reps: int, warmup: int) -> dict:
    """Median microseconds per call of each phase, "entry", BACKWARD and "total" (fwd+bwd), and the Triton launches
    per call, for `prepared` (bench.contenders.Prepared) with `phases` wrapped and Triton stubbed."""
    samples = defaultdict(list)
    with StubbedTriton() as stub:
        launches_before = stub.launches
        for rep in range(warmup + reps):
            spent = defaultdict(int)
            with timed_phases(phases, spent):
                begin = time.perf_counter_ns()
                loss = prepared.run()
                forward_done = time.perf_counter_ns()
                torch.autograd.grad(loss, prepared.inputs)
                end = time.perf_counter_ns()
            if rep == warmup - 1 or (warmup == 0 and rep == 0):
                launches_before = stub.launches
            if rep < warmup:
                continue
            spent["entry"] = (forward_done - begin) - sum(spent.values())
            spent[BACKWARD] = end - forward_done
            spent["total"] = end - begin
            for phase, ns in spent.items():
                samples[phase].append(ns / 1e3)
        launches = (stub.launches - launches_before) / reps
    order = ["entry"] + [phase for phase, _, _ in phases] + [BACKWARD, "total"]
    return {"us": {phase: statistics.median(samples[phase]) for phase in order}, "triton_launches": launches}


def build(num_rows: int, vocab: int, rows_per_sample: int):
    from .contenders import ERPO_OPTIONS
    from .problem import Shape, build_problem
    return build_problem("logits", Shape(f"V={vocab}", 64, vocab), num_rows, rows_per_sample=rows_per_sample,
                         query_frac=0.25, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0,
                         chunk_rows=num_rows, clip_low=ERPO_OPTIONS["clip_low"], clip_high=ERPO_OPTIONS["clip_high"])


def run(num_rows: int, vocab: int, rows_per_sample: int, reps: int, warmup: int, contenders=("erpo", "liger")):
    """{contender: measure(...)} on one problem; a contender that is not installed maps to its reason."""
    from .contenders import CONTENDERS
    problem = build(num_rows, vocab, rows_per_sample)
    results = {}
    for key in contenders:
        contender = next(c for c in CONTENDERS if c.key == key and c.path == "logits")
        missing = contender.requirement(torch.device("cpu"))
        if missing is not None:
            results[key] = f"{missing[0]}: {missing[1]}"
            continue
        results[key] = measure(contender.prepare(problem), PHASES[key], reps, warmup)
    return results


def markdown(results: dict) -> str:
    """One column per contender, one row per phase (microseconds per call, medians)."""
    measured = {key: value for key, value in results.items() if isinstance(value, dict)}
    phases = []
    for value in measured.values():
        phases += [phase for phase in value["us"] if phase not in phases]
    phases.remove("total")
    lines = ["| phase (host us per fwd+bwd, median) | " + " | ".join(measured) + " |",
             "|---|" + "---|" * len(measured)]
    for phase in phases + ["total"]:
        cells = [f"{value['us'][phase]:.0f}" if phase in value["us"] else "-" for value in measured.values()]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines.append("| Triton launches per call (not timed) | "
                 + " | ".join(f"{value['triton_launches']:g}" for value in measured.values()) + " |")
    for key, value in results.items():
        if not isinstance(value, dict):
            lines.append(f"\n{key}: {value}")
    return "\n".join(lines)


def main(argv=None):
    path = argparse.ArgumentParser(add_help=False)
    path.add_argument("--path", choices=("logits", "fused"), default="logits")
    known, argv = path.parse_known_args(argv)
    if known.path == "fused":  # the fused path's own options and table: bench/host_cost_fused.py
        from .host_cost_fused import main as fused_main
        return fused_main(argv)
    parser = argparse.ArgumentParser(prog="python -m bench.host_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024, help="token rows N")
    parser.add_argument("--vocab", type=int, default=128, help="V (the kernels do not run: small is honest)")
    parser.add_argument("--rows-per-sample", type=int, default=256)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--contenders", default="erpo,liger")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = run(args.n, args.vocab, args.rows_per_sample, args.reps, args.warmup,
                  [key.strip() for key in args.contenders.split(",") if key.strip()])
    print(f"N={args.n}, V={args.vocab}, {args.reps} calls each (after {args.warmup}), torch {torch.__version__}\n")
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "results": results}, file, indent=1)


if __name__ == "__main__":
    main()
