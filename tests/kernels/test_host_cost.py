"""`python -m bench.host_cost` (the host's microseconds per loss call, kernels stubbed out) runs on the CPU and
reports every phase of ours, with the Triton launches a call makes (and with `--path fused`, per phase and per chunk,
the aten launches and host reads too); its JSON records where the numbers come from (bench.provenance). It stubs
the interpreter's launcher, so it runs in its own process with TRITON_INTERPRET=1 (on a GPU machine too: those tests
are cpu_only, left out of the GPU lease's tier, whose logits stage runs `bench.host_cost --device cuda`); its times
are the machine's, not asserted."""
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.provenance import git_commit
from paths import worker_pythonpath

REPO = Path(__file__).resolve().parents[2]


def assert_provenance(meta: dict, command: str, commit: str) -> None:
    """The JSON's `meta` is bench.provenance's: the command as run, the commit, a UTC date of the last minutes."""
    assert (meta["command"], meta["commit"], meta["torch"]) == (command, commit, torch.__version__)
    date = datetime.datetime.fromisoformat(meta["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert datetime.datetime.now(datetime.timezone.utc) - date < datetime.timedelta(minutes=10)


@pytest.mark.cpu_only
def test_reports_each_phase_of_a_call_and_its_triton_launches(tmp_path):
    out = tmp_path / "host.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    options = ["--n", "64", "--rows-per-sample", "16", "--vocab", "37", "--reps", "3", "--warmup", "1", "--json",
               str(out), "--commit", "abc123"]
    done = subprocess.run([sys.executable, "-m", "bench.host_cost", *options],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert_provenance(record["meta"], "python -m bench.host_cost " + shlex.join(options), "abc123")
    results = record["results"]
    ours = results["erpo"]
    phases = ["entry", "validation", "loss node (kernels queued, metrics)", "autograd backward"]
    binding = "Triton launch binding, CUDA sm_90 (not in total)"
    checks = "Triton global-value checks (not in total)"
    assert list(ours["us"]) == phases + ["total", binding, checks]
    assert all(ours["us"][phase] > 0 for phase in phases)
    # forward: the row checks (which find the samples' spans too), logp/entropy, the objective's sample kernel (whose
    # last program finishes); backward: dlogits, which forms the objective's gradients itself (triton_logits_loss:
    # one autograd node)
    assert ours["triton_launches"] == 4
    # each launch bound as Triton binds it for an sm_90 target, in launch order, with its kernel's parameter count
    assert [launch["kernel"] for launch in ours["binding"]] == [
        "_first_bad_row_kernel", "_logp_entropy_forward_log2_kernel", "_objective_sample_finish_kernel",
        "_node_backward_log2_kernel"]
    assert all(launch["parameters"] > 0 and launch["us"] > 0 for launch in ours["binding"])
    # each launch's tensor arguments (a pointer each for the C launcher on CUDA): the row checks' token_kind,
    # sample_index, targets and code buffer (this problem has no token_weight or rollout_logp: passed as None)
    assert ours["binding"][0]["pointers"] == 4
    assert abs(ours["us"][binding] - sum(launch["us"] for launch in ours["binding"])) < 1e-6
    # each launch's check of its compiled kernel's global values (bench.kernel_globals, Triton's own list of them)
    assert abs(ours["us"][checks] - sum(launch["globals_us"] for launch in ours["binding"])) < 1e-6
    assert all(launch["globals_us"] >= 0 for launch in ours["binding"])
    # ours read no global in their kernels or the jit functions they call (their constants are parameters with
    # defaults): nothing to check per launch (18 globals before branch hostcost2, about 9 us on this CPU)
    assert [launch["globals"] for launch in ours["binding"]] == [0, 0, 0, 0]
    liger = results["liger"]
    assert isinstance(liger, str) or liger["triton_launches"] == 2  # not installed, or its forward and backward
    assert "| autograd backward |" in done.stdout and "| Triton launches per call | 4 |" in done.stdout
    assert f"| {binding} |" in done.stdout and "| erpo | `_objective_sample_finish_kernel` |" in done.stdout
    assert f"| {checks} |" in done.stdout


def run_fused_host_cost(*options: str) -> subprocess.CompletedProcess:
    """`python -m bench.host_cost --path fused --n 4096 --warmup 1 OPTIONS` in a process of its own under the
    interpreter, from the repository (its `--reps`, `--json` and other options given); asserts that it succeeded."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.host_cost", "--path", "fused", "--n", "4096", "--warmup", "1",
                           *options], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.cpu_only
def test_fused_path_reports_each_phase_and_chunk_with_its_launches_and_reads(tmp_path, monkeypatch):
    """`--path fused` on a small lm_head cut like qwen2.5-7b in 1 GiB (N=4096: 8 chunks of 512 rows, 2 groups of
    2048). The counts are the tests' LaunchCounter's and may only go down: per chunk 1 aten launch (the logits GEMM)
    and 5 Triton ones (the two row kernels, the objective's two, d weight's hidden rows), no host read; per group the
    d hidden and d weight GEMMs; per call 1 host read (the chunk plan's layout with the value checks' code)."""
    out = tmp_path / "fused.json"
    done = run_fused_host_cost("--reps", "2", "--json", str(out))
    record = json.loads(out.read_text())
    monkeypatch.chdir(REPO)  # the commit the run found there (git rev-parse HEAD, no --commit given)
    assert_provenance(record["meta"], f"python -m bench.host_cost --path fused --n 4096 --warmup 1 --reps 2 --json "
                                      f"{shlex.quote(str(out))}", git_commit())
    result = record["results"]["erpo"]
    assert (result["chunks"], result["groups"], result["chunk_rows"], result["group_rows"]) == (8, 2, 512, 2048)
    phases = result["phases"]
    assert list(phases) == ["entry", "validation", "op setup", "chunk plan", "objective setup", "chunk",
                            "group GEMMs", "objective value", "autograd backward", "total"]
    assert all(row["us"] > 0 for row in phases.values())
    chunk, group = phases["chunk"], phases["group GEMMs"]
    assert chunk["calls"] == 8 and group["calls"] == 2
    assert chunk["aten"] <= 1 * 8 and chunk["triton"] <= 5 * 8 and chunk["reads"] == 0
    assert group["aten"] <= 2 * 2 and group["triton"] == 0 and group["reads"] == 0
    # no fill or constant tensor per call (branch fusedsetup): d loss / d loss is the gradient kernel's constant, the
    # entry launches only the loss's addition of the anchor, which the op setup zeroes with logp and entropy in one
    # Triton launch; the op setup also queues the objective's global factors (two launches, before the read: branch
    # fusedgaps2), so the objective's setup after the read launches nothing (the layout's host work and upload); the
    # first chunk's forward row kernel is the op setup's too (queued by the plan, before the objective's setup:
    # branch gapsfollow), one of the chunks' 5 x 8 Triton launches
    assert phases["objective setup"]["aten"] == 0 and phases["objective setup"]["triton"] == 0
    assert phases["entry"]["aten"] <= 1
    assert phases["op setup"]["aten"] <= 3 and phases["op setup"]["triton"] <= 4
    assert chunk["triton"] + phases["op setup"]["triton"] <= 5 * 8 + 4
    # one host read, in the op: the rows' layout with the value checks' code, copied before the first chunk's first
    # half's GEMM (256 rows: 2 x 256 x D x V FLOPs at qwen2.5-7b's D=3584, V=152064), which it does not wait for
    assert phases["total"]["reads"] == 1 and phases["validation"]["reads"] == 0 and phases["op setup"]["reads"] == 1
    half_chunk = 2 * 256 * 3584 * 152064 / 1e9
    (read,) = result["reads"]
    assert abs(read["GFLOP queued, not waited for"] - half_chunk) < 1e-6
    # the first chunk's forward row kernel is queued by the plan, before the objective's setup and the chunk loop
    assert 0 < read["us to next GEMM"] < read["us to first row kernel"] < read["us to chunk loop"]
    assert abs(read["GFLOP queued before chunk loop"] - 2 * half_chunk) < 1e-6  # the whole first chunk
    # the logits GEMMs: the first chunk's in halves (before the read, then with the plan), one a chunk after
    assert result["logits_gemm_rows"] == LOGITS_GEMM_ROWS
    assert "| chunk | 8 |" in done.stdout and "Per chunk, its share of the group GEMMs included" in done.stdout


# rows of each logits GEMM of a call at N=4096 in chunks of 512 (`run_fused_host_cost`): the first chunk's two halves,
# then one GEMM a chunk
LOGITS_GEMM_ROWS = [256, 256] + [512] * 7


@pytest.mark.cpu_only
def test_fused_path_with_the_epilogue_row_pass_sees_its_logits_gemms(tmp_path):
    """`--path fused --epilogue` (EPILOGUE_ROW_PASS: each logits GEMM the Triton GEMM with the forward row pass in its
    epilogue, not cuBLAS's, which the loss then never calls): the tables see those GEMMs as they see cuBLAS's, the
    same chunks cut the same way (the workspace counting each row's statistics) and the same GFLOP queued around the
    read as without it; in the chunk loop each GEMM is a Triton launch and no aten one (the combine kernel in the
    forward row kernel's place)."""
    out = tmp_path / "fused.json"
    done = run_fused_host_cost("--reps", "1", "--epilogue", "--json", str(out))
    record = json.loads(out.read_text())
    assert record["args"]["epilogue"] is True
    result = record["results"]["erpo"]
    assert (result["chunks"], result["groups"], result["chunk_rows"], result["group_rows"]) == (8, 2, 512, 2048)
    assert result["logits_gemm_rows"] == LOGITS_GEMM_ROWS
    half_chunk = 2 * 256 * 3584 * 152064 / 1e9
    (read,) = result["reads"]
    assert abs(read["GFLOP queued, not waited for"] - half_chunk) < 1e-6
    assert abs(read["GFLOP queued before chunk loop"] - 2 * half_chunk) < 1e-6
    assert 0 < read["us to next GEMM"] < read["us to chunk loop"]
    # chunks 1 to 7: the GEMM, the combine, the objective's two, the backward row kernel, d weight's hidden rows;
    # chunk 0 the last four (its GEMMs and combine queued with the plan, in the op setup)
    chunk = result["phases"]["chunk"]
    assert chunk["aten"] == 0 and chunk["triton"] == 6 * 7 + 4
    assert "EPILOGUE_ROW_PASS" in done.stdout and "9 logits GEMMs of 4096 rows in all" in done.stdout


@pytest.mark.cpu_only
def test_fused_path_with_a_host_layout_queues_the_whole_first_chunk_before_its_read(tmp_path):
    """`--path fused --host-layout` (the rows' layout given in host memory, erpo's trainer's way): the call's one
    host read, the value checks' code, returns with the whole first chunk's logits GEMMs queued after its copy (the
    plan needs no read: `fused_linear_loss.plannable_layout`), and the next GEMM comes in the chunk loop."""
    out = tmp_path / "fused.json"
    done = run_fused_host_cost("--reps", "1", "--host-layout", "--json", str(out))
    result = json.loads(out.read_text())["results"]["erpo"]
    assert result["phases"]["total"]["reads"] == 1 and result["phases"]["op setup"]["reads"] == 1
    (read,) = result["reads"]
    first_chunk = 2 * 512 * 3584 * 152064 / 1e9
    assert abs(read["GFLOP queued, not waited for"] - first_chunk) < 1e-6
    assert abs(read["GFLOP queued before chunk loop"] - first_chunk) < 1e-6
    assert 0 < read["us to chunk loop"] < read["us to next GEMM"]
    assert read["us to first row kernel"] is None  # queued with the first chunk's logits, before the read
    assert "host_layout" in done.stdout


def kernel_globals(*references: str, interpret: bool = False) -> subprocess.CompletedProcess:
    """`python -m bench.kernel_globals REFERENCE ... --reps 3` in a process of its own, the interpreter off unless
    `interpret`, tests/support importable."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = worker_pythonpath()
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "bench.kernel_globals", *references, "--reps", "3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_kernel_globals_lists_what_triton_checks_on_each_launch():
    """bench.kernel_globals names the module-level constexprs a compiled kernel checks on every launch, its helpers'
    included, as Triton's own `used_global_vals` holds them, of one kernel or of every jit function of a module, and
    refuses the interpreter's kernels (which have none)."""
    kernel = "global_reading_kernel:reads_two_globals"
    done = kernel_globals(kernel)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.splitlines()[-1])[kernel]
    assert record["globals"] == ["HELPER_GLOBAL", "KERNEL_GLOBAL"] and record["us"] >= 0
    done = kernel_globals("global_reading_kernel")
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(done.stdout.splitlines()[-1])
    assert {reference: record["globals"] for reference, record in records.items()} == {
        kernel: ["HELPER_GLOBAL", "KERNEL_GLOBAL"], "global_reading_kernel:_times_helper_global": ["HELPER_GLOBAL"]}
    refused = kernel_globals(kernel, interpret=True)
    assert refused.returncode != 0 and "without TRITON_INTERPRET=1" in refused.stderr


def test_no_jit_function_of_the_package_reads_a_global():
    """No kernel of erpo_kernels, nor a jit function they call, reads a module-level constexpr: a compiled launch
    checks each such global's value anew (about 0.5 us a global on this project's CPU). Their constants are
    parameters with plain numbers as defaults (branch hostcost2; the shifted forward kernel's LSE_FLOOR and
    `_gradient_rows_kernel`'s IGNORE_INDEX since branch leftovers)."""
    done = kernel_globals("erpo_kernels")
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(done.stdout.splitlines()[-1])
    # the listing holds the launched kernels of both paths and their helpers, so an empty result is not vacuous
    assert {"erpo_kernels.triton_logits:_logp_entropy_forward_kernel",
            "erpo_kernels.triton_logits:_logp_entropy_forward_log2_kernel",
            "erpo_kernels.triton_gradient_rows:_gradient_rows_kernel",
            "erpo_kernels.triton_common:online_softmax_start",
            "erpo_kernels.triton_row_checks:_first_bad_row_kernel"} <= set(records)
    assert {reference: record["globals"] for reference, record in records.items() if record["globals"]} == {}
