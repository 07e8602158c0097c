"""bench.kernel_profile.idle_gaps on a hand-made profiler trace (the GPU run writes the real one): the GPU's idle time
between kernels, the part it waited for a late launch call, per next kernel, the largest gaps with the operator
that launched the next kernel, and the host's synchronizing CUDA calls."""
import json
import os
import subprocess
import sys

from bench.kernel_profile import gap_lines, idle_gaps
from paths import REPO, worker_pythonpath


def kernel(name, ts, dur, correlation):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def launch(ts, correlation, name="cudaLaunchKernel", dur=2.0):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


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
    assert gaps["syncs"] == {"cudaStreamSynchronize": {"count": 0.5, "us": 10.0}} and gaps["unmatched"] == 0
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
