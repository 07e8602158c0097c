"""Where one fwd+bwd (logits path, or fused path with `--path fused`) spends its time on the GPU: per contender,
the CUDA kernels of one call (torch.profiler: name, launches, microseconds each call), the call's wall time, the
time some kernel ran, and the GPU's idle time between the call's first kernel and its last (the host's share:
launches, Python, host reads).

    python -m bench.kernel_profile --n 16384 --contenders erpo,erpo-log2,liger --out DIR   # DIR/profile.{md,json}
    python -m bench.kernel_profile --path fused --shape qwen2.5-7b --contenders erpo --workspace-gib 4 --out DIR
    python -m bench.kernel_profile --path fused --contenders erpo --host-layout --out DIR   # and erpo@host-layout
    TRITON_INTERPRET=1 python -m bench.kernel_profile --smoke --out DIR    # CPU, tiny: the script's dry run

Each contender is warmed up (Triton compiles, allocator growth), runs one more call under the profiler's warm-up
step, and is then profiled over `--calls` fwd+bwd calls (the bench's, `bench.contenders.Prepared.step`), back to
back, inside a `record_function` range (RECORDED_CALLS); times are per call. Off CUDA (the dry run) the table lists
the top-level CPU operators of that range instead: no measurement.

PROFILER_WARMUP: until b8b4a78 the first profiled call was also the profiler's first traced one, and it started on
an empty queue: on the H100 (bench/measured/h100-2026-11-26) it alone held the gaps that the tables' per-call
averages spread over every call (the logits path's 565 of 575 us before the forward kernel, the other two calls 4.8
us each; the fused path's 950 us after the row checks). The recorded calls now follow one in flight, as the bench's
timed calls do and a training step's loss follows its model's forward.

What is counted (`recorded_calls_events`): the call in flight is queued in a few ms but runs for up to its whole GPU
time (a fused call: ~96 ms) after the profiler moves to its active step, so the trace holds the tail of its kernels
too; at 60b3625 (bench/measured/h100-2026-11-26-60b3625) they were counted as recorded ones (the fused path's
once-per-chunk kernels at 41 launches per call for 32 chunks, the profiler's own `ProfilerStep*` range listed as a
kernel and covering the busy time). Now every device event (kernel, copy, memset) is attributed to the CPU launch
call that queued it (the trace's `correlation` ids) and kept only when that call lies in RECORDED_CALLS: the table,
the busy time, the first-to-last-kernel span and `idle_gaps` all count the recorded calls' own device events, the
ones left out are counted ("left_out"), and the host's CUDA calls (syncs) are those inside the range. The wall is
timed on CUDA by events from the end of the call in flight to the end of the last recorded call (the GPU's time
for the recorded calls, the host's share included where the GPU waited for it); off CUDA by the host's clock.

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
RECORDED_CALLS = "kernel_profile: recorded calls"  # the record_function range around the calls profiled


def _busy_us(intervals) -> float:
    """Length of the union of (start, end) intervals (us)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def per_call_figures(intervals: list, calls: int) -> dict:
    """{"kernel_busy_us", "gpu_idle_us", "kernels": [{"name", "launches", "us"}]} per call of (name, start us,
    end us) intervals run by `calls` calls: the time some interval ran, the time none did between the first start and
    the last end, and per name the launches and microseconds, sorted by time."""
    per_name = defaultdict(lambda: [0, 0.0])
    for name, start, end in intervals:
        per_name[name][0] += 1
        per_name[name][1] += end - start
    busy = _busy_us((start, end) for _, start, end in intervals)
    span = max(end for _, _, end in intervals) - min(start for _, start, _ in intervals) if intervals else 0.0
    table = sorted(({"name": name, "launches": count / calls, "us": total / calls}
                    for name, (count, total) in per_name.items()), key=lambda row: -row["us"])
    return {"kernel_busy_us": busy / calls, "gpu_idle_us": max(span - busy, 0.0) / calls, "kernels": table}


def profile_calls(prepared, device: torch.device, calls: int, warmup: int = 2, trace_path=None) -> dict:
    """{"wall_us", "kernel_busy_us", "gpu_idle_us", "kernels": [{"name", "launches", "us"}]} per fwd+bwd call of
    `prepared` (bench.contenders.Prepared), the kernels sorted by time; off CUDA the top-level CPU operators. On
    CUDA the figures are `trace_profile`'s of the profiler's trace (written to trace_path when given): also "gaps"
    and "left_out"."""
    on_cuda = device.type == "cuda"
    step = prepared.step  # the bench's timed fwd+bwd (bench.contenders.Prepared.step)
    for _ in range(warmup):
        step()
    if on_cuda:
        torch.cuda.synchronize(device)
        in_flight_done, recorded_done = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    # one call under the profiler's warm-up step (set up, traced and discarded), then the calls recorded: the
    # profiler's start-up stays out of them, and they follow that call in flight (PROFILER_WARMUP)
    with torch.profiler.profile(activities=activities,
                                schedule=torch.profiler.schedule(wait=0, warmup=1, active=1)) as profiler:
        step()
        if on_cuda:
            in_flight_done.record()
        profiler.step()
        begin = time.perf_counter()
        with torch.profiler.record_function(RECORDED_CALLS):
            for _ in range(calls):
                step()
        if on_cuda:
            recorded_done.record()
            torch.cuda.synchronize(device)
            wall_us = in_flight_done.elapsed_time(recorded_done) * 1e3 / calls
        else:
            wall_us = (time.perf_counter() - begin) * 1e6 / calls
    if not on_cuda:
        operators = [e for e in profiler.events() if e.cpu_parent is not None and e.cpu_parent.name == RECORDED_CALLS]
        return {"wall_us": wall_us, **per_call_figures(
            [(e.name, e.time_range.start, e.time_range.end) for e in operators], calls)}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(trace_path or Path(folder) / "trace.json")
        profiler.export_chrome_trace(str(path))
        return {"wall_us": wall_us, **trace_profile(json.loads(path.read_text())["traceEvents"], calls)}


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # cudaLaunchKernel, cuLaunchKernel (Triton), cudaMemcpyAsync...
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")
TOP_GAPS = 12


def recorded_calls_events(events: list, marker: str = RECORDED_CALLS) -> tuple[list, int]:
    """The events of a torch.profiler chrome trace ("ts" / "dur" in us) that belong to the calls run inside the host
    range `marker` (a record_function: "user_annotation" in the trace), and how many device events were left out.
    Kept: the host events that start inside the range, and the device events (kernels, copies, memsets) whose launch
    call, matched by "correlation", is one of them. Left out: device events queued before the range (a call still in
    flight when it began: its launch calls fall before the trace's active window) or after it."""
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"] == marker]
    if len(ranges) != 1:
        raise ValueError(f"trace: {len(ranges)} ranges named {marker!r}, expected one (the record_function around "
                         f"the recorded calls)")
    begin, end = ranges[0]["ts"], ranges[0]["ts"] + ranges[0]["dur"]
    complete = [e for e in events if e.get("ph") == "X" and e is not ranges[0]]
    host = [e for e in complete if e.get("cat") not in (*DEVICE_CATEGORIES, "gpu_user_annotation")
            and begin <= e["ts"] <= end]
    launched = {e["args"]["correlation"] for e in host
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    device = [e for e in complete if e.get("cat") in DEVICE_CATEGORIES]
    kept = [e for e in device if e.get("args", {}).get("correlation") in launched]
    return host + kept, len(device) - len(kept)


def trace_profile(events: list, calls: int, marker: str = RECORDED_CALLS) -> dict:
    """`per_call_figures` of the device events (kernels, copies, memsets) of the `calls` calls inside `marker`
    (`recorded_calls_events` of a torch.profiler chrome trace), with "gaps" (`idle_gaps` of the same events: its
    "idle_us" is the figures' "gpu_idle_us") and "left_out" (device events in the trace not theirs: a count)."""
    recorded, left_out = recorded_calls_events(events, marker)
    device = [e for e in recorded if e.get("cat") in DEVICE_CATEGORIES]
    return {**per_call_figures([(e["name"], e["ts"], e["ts"] + e["dur"]) for e in device], calls),
            "gaps": idle_gaps(recorded, calls), "left_out": left_out}


def idle_gaps(events: list, calls: int) -> dict:
    """Per call: the GPU's idle time between kernels (trace events of a torch.profiler chrome trace, "ts" / "dur"
    in us), "host_wait_us" of it before a kernel whose launch call ended after the GPU ran dry (the host was late),
    "by_next_kernel" [{"name", "gaps", "idle_us", "host_wait_us"}] (gaps of at least 1 us), "largest" gaps
    [{"idle_us", "host_wait_us", "after", "before", "launched_by"}] (the innermost CPU operator around the launch
    call) and "syncs" {CUDA call: {"count", "us"}} (the host blocking on the device: a host read). A kernel whose
    launch call is not among the events (`recorded_calls_events` keeps none such) counts its gap as launch latency."""
    ordered = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
                     key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    per_kernel = defaultdict(lambda: [0, 0.0, 0.0])
    gaps, idle, waited, reach, previous = [], 0.0, 0.0, None, None
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
                                          for name, (count, us) in syncs.items()}}


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
        left_out = (f"; device events in the trace launched outside the recorded calls (left out: the call in flight "
                    f"before them) {result['left_out']}" if "left_out" in result else "")
        lines += ["", f"wall {result['wall_us']:.0f} us per call (the profiler's host overhead included: the bench's "
                      f"times are the measurement); some kernel running {result['kernel_busy_us']:.0f} us; GPU idle "
                      f"between the call's first and last kernel {result['gpu_idle_us']:.0f} us{left_out}", "",
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
             f"{syncs or 'none'}", "",
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
            prepare(problem), device, 1 if args.smoke else args.calls, warmup=0 if args.smoke else 2,
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
