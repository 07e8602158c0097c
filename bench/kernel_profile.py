"""Where one fwd+bwd (logits path, or fused path with `--path fused`) spends its time on the GPU: per contender,
the CUDA kernels of one call (torch.profiler: name, launches, microseconds each call), the call's wall time, the
time some kernel ran, and the GPU's idle time between the call's first kernel and its last (the host's share:
launches, Python, host reads).

    python -m bench.kernel_profile --n 16384 --contenders erpo,erpo-log2,liger --out DIR   # DIR/profile.{md,json}
    python -m bench.kernel_profile --path fused --shape qwen2.5-7b --contenders erpo --workspace-gib 4 --out DIR
    TRITON_INTERPRET=1 python -m bench.kernel_profile --smoke --out DIR    # CPU, tiny: the script's dry run

Each contender is warmed up (Triton compiles, allocator growth) and then profiled over `--calls` fwd+bwd calls;
times are per call. Off CUDA (the dry run) the table lists the top-level CPU operators instead: no measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from .provenance import header_lines, provenance

SMOKE_ROWS, SMOKE_ROWS_PER_SAMPLE, SMOKE_VOCAB = 32, 16, 64  # the dry run's problem: the interpreter is slow


def _busy_us(intervals) -> float:
    """Length of the union of (start, end) intervals (us)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def profile_calls(prepared, device: torch.device, calls: int, warmup: int = 2) -> dict:
    """{"wall_us", "kernel_busy_us", "gpu_idle_us", "kernels": [{"name", "launches", "us"}]} per fwd+bwd call of
    `prepared` (bench.contenders.Prepared), the kernels sorted by time; off CUDA the top-level CPU operators."""
    on_cuda = device.type == "cuda"

    def step():
        torch.autograd.grad(prepared.run(), prepared.inputs)

    for _ in range(warmup):
        step()
    if on_cuda:
        torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    with torch.profiler.profile(activities=activities) as profiler:
        begin = time.perf_counter()
        for _ in range(calls):
            step()
        if on_cuda:
            torch.cuda.synchronize(device)
        wall_us = (time.perf_counter() - begin) * 1e6 / calls
    events = profiler.events()
    if on_cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        kernels = [e for e in events if e.cpu_parent is None]
    per_name = defaultdict(lambda: [0, 0.0])
    for event in kernels:
        per_name[event.name][0] += 1
        per_name[event.name][1] += event.time_range.elapsed_us()
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    busy = _busy_us(spans) / calls
    span = (max(end for _, end in spans) - min(start for start, _ in spans)) / calls if spans else 0.0
    table = sorted(({"name": name, "launches": count / calls, "us": total / calls}
                    for name, (count, total) in per_name.items()), key=lambda row: -row["us"])
    return {"wall_us": wall_us, "kernel_busy_us": busy, "gpu_idle_us": max(span - busy, 0.0), "kernels": table}


def markdown(results: dict, meta: dict) -> str:
    lines = [f"# One {meta['path']}-path fwd+bwd, kernel by kernel ({meta['device']}, N={meta['N']}, D={meta['D']}, "
             f"V={meta['V']}, {meta['dtype']}, "
             f"{meta['calls']} calls)", "", *header_lines(meta), ""]
    unit = "kernel" if meta["device"] != "cpu" else "top-level CPU operator (dry run: not a measurement)"
    for key, result in results.items():
        lines.append(f"## {key}")
        if isinstance(result, str):
            lines += ["", result, ""]
            continue
        lines += ["", f"wall {result['wall_us']:.0f} us per call (the profiler's host overhead included: the bench's "
                      f"times are the measurement); some kernel running {result['kernel_busy_us']:.0f} us; GPU idle "
                      f"between the call's first and last kernel {result['gpu_idle_us']:.0f} us", "",
                  f"| {unit} | launches | us per call |", "|---|---|---|"]
        lines += [f"| `{row['name'][:110]}` | {row['launches']:g} | {row['us']:.1f} |" for row in result["kernels"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("logits", "fused"), default="logits")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=152064, help="the logits path's V")
    parser.add_argument("--shape", default="qwen2.5-7b", help="the fused path's lm_head (bench.problem.parse_shape)")
    parser.add_argument("--workspace-gib", default="",
                        help="fused path: comma-separated workspace budgets for ours (GiB), each profiled as "
                             "erpo@ws=G; default: the library's")
    parser.add_argument("--contenders", default="erpo,liger")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, Triton interpreter: a dry run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD, if any; a "
                                                          "GPU machine's copy of the tree may hold another .git)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the contenders import Triton
    from .contenders import CONTENDERS, ERPO_OPTIONS, erpo_fused_with_workspace
    from .problem import SMOKE_SHAPE, Shape, build_problem, parse_shape

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    rows, rows_per_sample = (SMOKE_ROWS, SMOKE_ROWS_PER_SAMPLE) if args.smoke else (args.n, 1024)
    if args.path == "fused":
        shape = SMOKE_SHAPE if args.smoke else parse_shape(args.shape)
    else:
        shape = Shape(f"V={SMOKE_VOCAB if args.smoke else args.vocab}", 0, SMOKE_VOCAB if args.smoke else args.vocab)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    problem = build_problem(args.path, shape, rows, rows_per_sample=rows_per_sample, query_frac=0.25, dtype=dtype,
                            device=device, seed=0, chunk_rows=4096, clip_low=ERPO_OPTIONS["clip_low"],
                            clip_high=ERPO_OPTIONS["clip_high"])
    prepares = {}
    for key in [key.strip() for key in args.contenders.split(",") if key.strip()]:
        contender = next((c for c in CONTENDERS if c.key == key and c.path == args.path), None)
        if contender is None:
            raise SystemExit(f"--contenders: no {args.path}-path contender {key!r}")
        missing = contender.requirement(device)
        prepares[key] = f"{missing[0]}: {missing[1]}" if missing is not None else contender.prepare
    for gib in [float(g) for g in args.workspace_gib.split(",") if g.strip()]:
        if args.path != "fused":
            raise SystemExit("--workspace-gib: only with --path fused")
        prepares[f"erpo@ws={gib:g}"] = erpo_fused_with_workspace(int(gib * 2**30))
    results = {}
    for key, prepare in prepares.items():
        results[key] = prepare if isinstance(prepare, str) else profile_calls(
            prepare(problem), device, 1 if args.smoke else args.calls, warmup=1 if args.smoke else 2)
        print(f"{key}: " + (results[key] if isinstance(results[key], str) else
                            f"wall {results[key]['wall_us']:.0f} us, idle {results[key]['gpu_idle_us']:.0f} us"),
              flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "N": rows,
            "path": args.path, "D": shape.hidden, "V": shape.vocab, "dtype": str(dtype).removeprefix("torch."),
            "calls": 1 if args.smoke else args.calls,
            **provenance("bench.kernel_profile", sys.argv[1:] if argv is None else argv, args.commit)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.md").write_text(markdown(results, meta))
    (out / "profile.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
