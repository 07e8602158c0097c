"""bench.kernel_profile on hand-made profiler traces (the GPU run writes the real ones): which device events belong to
the recorded calls (their launch calls inside the RECORDED_CALLS range, not those of the call in flight before them),
their per-call table and busy / idle time; `idle_gaps`: the GPU's idle time between kernels, the part it waited for a
late launch call, per next kernel, the largest gaps with the operator that launched the next kernel, and the host's
synchronizing CUDA calls. Also one H100 trace as the 60b3625 gpu_check wrote it, and the CPU path."""
import json
import os
import subprocess
import sys

import pytest
import torch

from bench.contenders import Prepared
from bench.kernel_profile import (
    RECORDED_CALLS,
    gap_lines,
    idle_gaps,
    profile_calls,
    recorded_calls_events,
    trace_profile,
)
from paths import REPO, worker_pythonpath


def kernel(name, ts, dur, correlation):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def launch(ts, correlation, name="cudaLaunchKernel", dur=2.0):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def annotation(name, ts, dur, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {}}


def in_flight_then_two_calls():
    """A trace as torch.profiler writes it for one call in flight then two recorded ones (times in us): the call in
    flight launched its last two "chunk" kernels before the recorded calls began, one launch call before the trace's
    window (absent), one inside it (at 60); they run 100-140 and 140-180, while the recorded calls' launches queue up
    behind them. Each recorded call: two "chunk" kernels (launched through the driver, as Triton does), a memset and
    a "finish" after a host read."""
    events = [annotation("ProfilerStep#1", 50, 400), annotation("ProfilerStep#1", 100, 330, "gpu_user_annotation"),
              annotation(RECORDED_CALLS, 70, 300), annotation(RECORDED_CALLS, 180, 250, "gpu_user_annotation"),
              launch(60, 2), kernel("chunk", 100, 40, 1), kernel("chunk", 140, 40, 2)]
    for call, start in enumerate((180, 300)):
        base, at = 10 * (call + 1), 80 + 200 * call
        events += [
            launch(at, base, name="cuLaunchKernelEx"), kernel("chunk", start, 30, base),
            launch(at + 5, base + 1, name="cuLaunchKernelEx"), kernel("chunk", start + 30, 30, base + 1),
            launch(at + 10, base + 2, name="cudaMemsetAsync"),
            {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": start + 62, "dur": 2,
             "args": {"correlation": base + 2}},
            # the host read waits for the chunks; "finish" is launched after it, inside its operator
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": at + 15,
             "dur": start + 64 - (at + 15), "args": {}},
            {"ph": "X", "cat": "cpu_op", "name": "finish_op", "ts": start + 64, "dur": 10},
            launch(start + 66, base + 3), kernel("finish", start + 74, 6, base + 3)]
    # the profiler harness's own sync after the recorded calls: not theirs
    return events + [{"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 420, "dur": 5,
                      "args": {}}]


def test_the_call_in_flight_is_left_out_and_each_count_is_the_recorded_calls_own():
    events = in_flight_then_two_calls()
    recorded, left_out = recorded_calls_events(events)
    assert left_out == 2  # the in-flight call's two kernels: launched before the range, or outside the trace
    assert {e["name"] for e in recorded if e["cat"] == "kernel"} == {"chunk", "finish"}
    assert min(e["ts"] for e in recorded if e["cat"] == "kernel") == 180
    profile = trace_profile(events, calls=2)
    # per call: 2 chunks (60 us), one memset, one finish; no ProfilerStep / range rows
    assert profile["kernels"] == [{"name": "chunk", "launches": 2.0, "us": 60.0},
                                  {"name": "finish", "launches": 1.0, "us": 6.0},
                                  {"name": "Memset (Device)", "launches": 1.0, "us": 2.0}]
    assert profile["left_out"] == 2
    # each call runs 180-240, memset 242-244, finish 254-260 (then 300-...-380): busy 68 us, idle 2 + 10 per call
    # and the 40 us between the calls, over 2 calls; the gaps' idle time is the same figure
    assert profile["kernel_busy_us"] == 68.0
    assert profile["gpu_idle_us"] == (2 * 12 + 40) / 2 == profile["gaps"]["idle_us"]
    # the host's syncs: the two host reads inside the calls, not the harness's final cudaDeviceSynchronize
    assert list(profile["gaps"]["syncs"]) == ["cudaEventSynchronize"]
    assert profile["gaps"]["syncs"]["cudaEventSynchronize"]["count"] == 1.0


def test_a_trace_without_the_recorded_range_is_refused():
    events = [event for event in in_flight_then_two_calls() if event["name"] != RECORDED_CALLS]
    with pytest.raises(ValueError, match=f"0 ranges named '{RECORDED_CALLS}'"):
        trace_profile(events, calls=2)


def test_the_60b3625_h100_trace_counts_whole_launches_per_call():
    """bench/measured/h100-2026-11-26-60b3625: liger's logits-path trace, where 23 device events of the call in
    flight ran after the profiler's active step began (its table listed 5.667 launches of a fill kernel per call, and
    `ProfilerStep*`). That run had no RECORDED_CALLS range: its active step's range, ProfilerStep#1, held the 3
    recorded calls and the final synchronize."""
    path = REPO / "bench/measured/h100-2026-11-26-60b3625/logits/profile/liger.trace.json"
    profile = trace_profile(json.loads(path.read_text())["traceEvents"], calls=3, marker="ProfilerStep#1")
    assert profile["left_out"] == 23
    assert all(row["launches"] == round(row["launches"]) for row in profile["kernels"]), profile["kernels"]
    assert [row["name"] for row in profile["kernels"][:2]] == ["_grpo_loss_bwd_kernel", "_grpo_loss_fwd_kernel"]
    assert not any(row["name"].startswith("ProfilerStep") for row in profile["kernels"])
    assert profile["gpu_idle_us"] == pytest.approx(profile["gaps"]["idle_us"])


def test_off_cuda_the_table_is_the_recorded_calls_top_level_operators():
    weight = torch.randn(8, 8)
    inputs = torch.randn(4, 8, requires_grad=True)
    prepared = Prepared(lambda: (inputs @ weight).sum(), [inputs], lambda grads: {})
    profile = profile_calls(prepared, torch.device("cpu"), calls=3, warmup=1)
    launches = {row["name"]: row["launches"] for row in profile["kernels"]}
    assert launches["aten::matmul"] == 1.0 and launches["aten::sum"] == 1.0
    assert not any(name.startswith("ProfilerStep") or name == RECORDED_CALLS for name in launches)
    assert profile["wall_us"] > 0 and "gaps" not in profile


def test_idle_gaps_split_host_waits_from_launch_latency_per_call():
    events = [
        # GEMM queued long before; its next kernel "fwd" launched at 95 (ends 97) while the GEMM ran to 100: 4 us of
        # launch latency, no wait for the host
        launch(0, 1), kernel("gemm", 10, 90, 1), launch(95, 2), kernel("fwd", 104, 6, 2),
        # the host blocks on a read (cudaStreamSynchronize 110-130), then launches "objective" inside aten::foo at
        # 160 (ends 162): the GPU, dry from 110, waited 52 us for the host and 3 more for the launch itself
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 110, "dur": 20, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::foo", "ts": 150, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "name": "outer", "ts": 100, "dur": 100},
        launch(160, 3), kernel("objective", 165, 5, 3),
        # a second call: the same "fwd" after a GEMM, and a copy overlapping nothing
        launch(200, 4), kernel("gemm", 205, 50, 4), launch(210, 5), kernel("fwd", 256, 4, 5),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 262, "dur": 1, "args": {"correlation": 6}},
        launch(259, 6, name="cudaMemcpyAsync"),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 300},  # not a complete event: ignored
    ]
    gaps = idle_gaps(events, calls=2)
    # gaps: 4 (before fwd), 55 (before objective), 35 (before the second gemm), 1, 2: 97 us in 2 calls
    assert gaps["idle_us"] == 97 / 2
    # only the objective's launch and the second gemm's (launched at 200, ends 202: 32 us after 170) came late, and
    # the copy's (259-261 against the fwd's end at 260: 1 us)
    assert gaps["host_wait_us"] == (52 + 32 + 1) / 2
    by_kernel = {row["name"]: row for row in gaps["by_next_kernel"]}
    assert by_kernel["fwd"] == {"name": "fwd", "gaps": 1.0, "idle_us": (4 + 1) / 2, "host_wait_us": 0.0}
    assert by_kernel["objective"]["host_wait_us"] == 26.0
    largest = gaps["largest"][0]
    assert (largest["idle_us"], largest["before"], largest["after"], largest["launched_by"]) == (
        55, "objective", "fwd", "aten::foo")
    assert gaps["syncs"] == {"cudaStreamSynchronize": {"count": 0.5, "us": 10.0}}
    text = "\n".join(gap_lines(gaps))
    assert "cudaStreamSynchronize 0.5 (10 us)" in text and "| `objective` | 0.5 | 27.5 | 26.0 |" in text


def test_the_fused_profile_adds_ours_with_a_host_layout(tmp_path):
    """`--path fused --host-layout` (the dry run on the CPU): ours given the rows' layout in host memory, as erpo's
    trainer passes it, profiled beside ours without it (its own section, the loss op at its top); the logits path
    refuses the flag in one line."""
    out = tmp_path / "profile"
    env = {**os.environ, "PYTHONPATH": worker_pythonpath()}
    command = [sys.executable, "-m", "bench.kernel_profile", "--smoke", "--path", "fused", "--contenders", "erpo",
               "--host-layout", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((out / "profile.json").read_text())["results"]
    assert list(results) == ["erpo", "erpo@host-layout"]
    assert results["erpo@host-layout"]["kernels"][0]["name"] == "erpo::fused_linear_erpo_loss_gradients"
    refused = subprocess.run([*command[:5], "logits", *command[6:]], cwd=REPO, capture_output=True, text=True,
                             timeout=300, env=env)
    assert refused.returncode != 0 and refused.stderr.strip().splitlines()[-1] == (
        "--host-layout: only with --path fused")
