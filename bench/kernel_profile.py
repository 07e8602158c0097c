"""Where one fwd+bwd (logits path, or fused path with `--path fused`) spends its time on the GPU: per contender,
the CUDA kernels of one call (torch.profiler: name, launches, microseconds each call), the call's wall time, the
time some kernel ran, and the GPU's idle time between the call's first kernel and its last (the host's share:
launches, Python, host reads).

    python -m bench.kernel_profile --n 16384 --contenders erpo,erpo-log2,liger --out DIR   # DIR/profile.{md,json}
    python -m bench.kernel_profile --path fused --shape qwen2.5-7b --contenders erpo --workspace-gib 4 --out DIR
    python -m bench.kernel_profile --path fused --contenders erpo --host-layout --out DIR   # and erpo@host-layout
    TRITON_INTERPRET=1 python -m bench.kernel_profile --smoke --out DIR    # CPU, tiny: the script's dry run

Each contender is warmed up (Triton compiles, allocator growth), runs one more call under the profiler's warm-up
step, and is then profiled over `--calls` fwd+bwd calls, back to back; times are per call. Off CUDA (the dry run) the
table lists the top-level CPU operators instead: no measurement.

PROFILER_WARMUP: until b8b4a78 the first profiled call was also the profiler's first traced one, and it started on
an empty queue: on the H100 (bench/measured/h100-2026-11-26) it alone held the gaps that the tables' per-call
averages spread over every call (the logits path's 565 of 575 us before the forward kernel, the other two calls 4.8
us each; the fused path's 950 us after the row checks). The recorded calls now follow one in flight, as the bench's
timed calls do and a training step's loss follows its model's forward.

Where the GPU idles (`idle_gaps`, on CUDA): from the profiler's trace (also written, KEY.trace.json), every gap
between one kernel's end and the next one's start, split into the time the GPU waited for the host (the next
kernel's launch call came after the GPU ran dry: host work, or a host read that drained the queue) and launch
latency; per call, by the kernel after the gap (a per-chunk wait shows as one gap per chunk before the same kernel),
the largest gaps with the CPU operator that launched the next kernel, and the host's synchronizing CUDA calls.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
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


def profile_calls(prepared, device: torch.device, calls: int, warmup: int = 2, trace_path=None) -> dict:
    """{"wall_us", "kernel_busy_us", "gpu_idle_us", "kernels": [{"name", "launches", "us"}]} per fwd+bwd call of
    `prepared` (bench.contenders.Prepared), the kernels sorted by time; off CUDA the top-level CPU operators. On
    CUDA also "gaps" (`idle_gaps` of the profiler's trace, written to trace_path when given)."""
    on_cuda = device.type == "cuda"

    def step():
        torch.autograd.grad(prepared.run(), prepared.inputs)

    for _ in range(warmup):
        step()
    if on_cuda:
        torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    # one call under the profiler's warm-up step (set up, traced and discarded), then the calls recorded: the
    # profiler's start-up stays out of them (PROFILER_WARMUP)
    with torch.profiler.profile(activities=activities,
                                schedule=torch.profiler.schedule(wait=0, warmup=1, active=1)) as profiler:
        step()
        profiler.step()
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
        kernels = [e for e in events if not e.name.startswith("ProfilerStep")  # the schedule's step, around all
                   and (e.cpu_parent is None or e.cpu_parent.name.startswith("ProfilerStep"))]
    per_name = defaultdict(lambda: [0, 0.0])
    for event in kernels:
        per_name[event.name][0] += 1
        per_name[event.name][1] += event.time_range.elapsed_us()
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    busy = _busy_us(spans) / calls
    span = (max(end for _, end in spans) - min(start for start, _ in spans)) / calls if spans else 0.0
    table = sorted(({"name": name, "launches": count / calls, "us": total / calls}
                    for name, (count, total) in per_name.items()), key=lambda row: -row["us"])
    result = {"wall_us": wall_us, "kernel_busy_us": busy, "gpu_idle_us": max(span - busy, 0.0), "kernels": table}
    if on_cuda:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(trace_path or Path(folder) / "trace.json")
            profiler.export_chrome_trace(str(path))
            result["gaps"] = idle_gaps(json.loads(path.read_text())["traceEvents"], calls)
    return result


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # cudaLaunchKernel, cuLaunchKernel (Triton), cudaMemcpyAsync...
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")
TOP_GAPS = 12


def idle_gaps(events: list, calls: int) -> dict:
    """Per call: the GPU's idle time between kernels (trace events of a torch.profiler chrome trace, "ts" / "dur"
    in us), "host_wait_us" of it before a kernel whose launch call ended after the GPU ran dry (the host was late),
    "by_next_kernel" [{"name", "gaps", "idle_us", "host_wait_us"}] (gaps of at least 1 us), "largest" gaps
    [{"idle_us", "host_wait_us", "after", "before", "launched_by"}] (the innermost CPU operator around the launch
    call), "syncs" {CUDA call: {"count", "us"}} (the host blocking on the device: a host read) and "unmatched":
    kernels whose launch call is not in the trace (their gaps count as launch latency)."""
    ordered = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
                     key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    per_kernel = defaultdict(lambda: [0, 0.0, 0.0])
    gaps, idle, waited, reach, previous = [], 0.0, 0.0, None, None
    unmatched = sum(event.get("args", {}).get("correlation") not in launches for event in ordered)
    for event in ordered:
        if reach is not None and event["ts"] > reach:
            gap = event["ts"] - reach
            launch = launches.get(event.get("args", {}).get("correlation"))
            late = min(gap, max(0.0, launch["ts"] + launch["dur"] - reach)) if launch else 0.0
            idle, waited = idle + gap, waited + late
            if gap >= 1.0:
                entry = per_kernel[event["name"]]
                entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + gap, entry[2] + late
            gaps.append((gap, late, previous["name"], event["name"], launch))
        if reach is None or event["ts"] + event["dur"] > reach:
            reach, previous = event["ts"] + event["dur"], event
    largest = []
    for gap, late, after, before, launch in sorted(gaps, key=lambda g: -g[0])[:TOP_GAPS]:
        around = [op for op in cpu_ops if launch and op["ts"] <= launch["ts"] <= op["ts"] + op["dur"]]
        largest.append({"idle_us": gap, "host_wait_us": late, "after": after, "before": before,
                        "launched_by": min(around, key=lambda op: op["dur"])["name"] if around else "-"})
    syncs = defaultdict(lambda: [0, 0.0])
    for event in events:
        if event.get("cat") in LAUNCH_CATEGORIES and event.get("name") in SYNC_CALLS:
            syncs[event["name"]][0] += 1
            syncs[event["name"]][1] += event.get("dur", 0.0)
    by_kernel = sorted(({"name": name, "gaps": count / calls, "idle_us": gap / calls, "host_wait_us": late / calls}
                        for name, (count, gap, late) in per_kernel.items()), key=lambda row: -row["idle_us"])
    return {"idle_us": idle / calls, "host_wait_us": waited / calls, "by_next_kernel": by_kernel[:TOP_GAPS],
            "largest": largest, "syncs": {name: {"count": count / calls, "us": us / calls}
                                          for name, (count, us) in syncs.items()}, "unmatched": unmatched / calls}


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
        if "gaps" in result:
            lines += gap_lines(result["gaps"])
    return "\n".join(lines)


def gap_lines(gaps: dict) -> list:
    """The markdown of `idle_gaps`' result."""
    syncs = ", ".join(f"{name} {value['count']:g} ({value['us']:.0f} us)" for name, value in gaps["syncs"].items())
    lines = [f"GPU idle between kernels {gaps['idle_us']:.0f} us per call, {gaps['host_wait_us']:.0f} us of it "
             f"waiting for the host (the next launch call ended after the GPU ran dry); host syncs per call: "
             f"{syncs or 'none'}; kernels without a launch call in the trace per call: {gaps['unmatched']:g}", "",
             "| idle before kernel | gaps per call | idle us per call | waiting for the host us per call |",
             "|---|---|---|---|"]
    lines += [f"| `{row['name'][:90]}` | {row['gaps']:g} | {row['idle_us']:.1f} | {row['host_wait_us']:.1f} |"
              for row in gaps["by_next_kernel"]]
    lines += ["", "| largest gaps (us) | waiting for the host | after kernel | before kernel | launched inside |",
              "|---|---|---|---|---|"]
    lines += [f"| {row['idle_us']:.1f} | {row['host_wait_us']:.1f} | `{row['after'][:60]}` | `{row['before'][:60]}` "
              f"| `{row['launched_by'][:50]}` |" for row in gaps["largest"]]
    return lines + [""]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("logits", "fused"), default="logits")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=152064, help="the logits path's V")
    parser.add_argument("--shape", default="qwen2.5-7b", help="the fused path's lm_head (bench.problem.parse_shape)")
    parser.add_argument("--workspace-gib", default="",
                        help="fused path: comma-separated workspace budgets for ours (GiB), each profiled as "
                             "erpo@ws=G; default: the library's")
    parser.add_argument("--host-layout", action="store_true",
                        help="fused path: also ours given the rows' layout in host memory (host_layout=, as erpo's "
                             "trainer passes it), profiled as erpo@host-layout")
    parser.add_argument("--contenders", default="erpo,liger")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, Triton interpreter: a dry run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD, if any; a "
                                                          "GPU machine's copy of the tree may hold another .git)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the contenders import Triton
    from .contenders import CONTENDERS, ERPO_OPTIONS, erpo_fused_with_host_layout, erpo_fused_with_workspace
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
    if args.host_layout:
        if args.path != "fused":
            raise SystemExit("--host-layout: only with --path fused")
        prepares["erpo@host-layout"] = erpo_fused_with_host_layout
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for key, prepare in prepares.items():
        results[key] = prepare if isinstance(prepare, str) else profile_calls(
            prepare(problem), device, 1 if args.smoke else args.calls, warmup=1 if args.smoke else 2,
            trace_path=out / f"{key}.trace.json")
        print(f"{key}: " + (results[key] if isinstance(results[key], str) else
                            f"wall {results[key]['wall_us']:.0f} us, idle {results[key]['gpu_idle_us']:.0f} us"),
              flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "N": rows,
            "path": args.path, "D": shape.hidden, "V": shape.vocab, "dtype": str(dtype).removeprefix("torch."),
            "calls": 1 if args.smoke else args.calls,
            **provenance("bench.kernel_profile", sys.argv[1:] if argv is None else argv, args.commit)}
    (out / "profile.md").write_text(markdown(results, meta))
    (out / "profile.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
