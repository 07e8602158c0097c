"""`bash bench/gpu_check.sh --dry-run`: the GPU lease's one command, run on the CPU with its stages shrunk, writes
every stage's results into at most 8 files; a stage past its time limit is stopped with its children, and no stage
starts past the deadline; on a GPU (here a fake nvidia-smi) the clocks are sampled from the first stage to the last
and stopped whatever the stages did. The dry run's logits stage is CI's one run of `bash bench/logits_gpu_check.sh
--dry-run`: its results are checked here."""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bench import gpu_check, gpu_clocks
from bench.progress import read_runs
from bench.provenance import header_lines
from paths import worker_pythonpath

REPO = Path(__file__).resolve().parents[2]
FILES = {"summary.md", "gpu_check.log", "kernel-tests.log", "logits.tar.gz", "train-metrics.jsonl", "bench.log",
         "bench.jsonl", "clocks.csv"}  # the device tool brings back 8 files at most


@pytest.fixture(autouse=True)
def _work_under_tmp_path(tmp_path, monkeypatch):
    """A GpuCheck keeps its work folder (tempfile.mkdtemp) after the check: each test's goes under its tmp_path."""
    work = tmp_path / "tmp"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    monkeypatch.setenv("TMPDIR", str(work))   # the dry run's: a process of its own


def test_dry_run_writes_each_stages_results(tmp_path):
    out = tmp_path / "out"
    # PYTHONPATH: Triton's interpreter in the stages' processes patched once per launch, as in the suite's own
    # (tests/support/interpreter_site: the same values, less CPU time; CHANGELOG.md)
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": worker_pythonpath()}
    env.pop("TRITON_INTERPRET", None)  # the dry run sets it for its stages itself
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--commit", "abc123", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=gpu_check.DRY_RUN_DEADLINE_S + 60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == FILES - {"clocks.csv"}  # no GPU, no clock samples
    summary = (out / "summary.md").read_text()
    table = summary[:summary.index("## Kernel tier")]  # the stages' table (the summary's later tables hold rows too)
    stages = [line.split(" | ")[:2] for line in table.splitlines() if line.startswith("| ") and " | ok | " in line]
    assert [name for name, _ in stages] == [*RUN_ORDER, "| bench merge"]
    assert "- clocks: not sampled: dry run on the CPU" in table
    assert all(line.split(" | ")[5:10] == ["-"] * 5 for line in table.splitlines() if " | ok | " in line)
    # the training's output in gpu_check.log, under its command
    assert re.search(r"^\$ .* -m erpo train .*\n(.*\n)*.*INFO erpo: done: ", (out / "gpu_check.log").read_text(), re.M)
    # the device guard's tests and test_target_gradient_exact_in_bf16 once per forward variant
    from erpo_kernels.triton_logits import FORWARD_VARIANTS
    assert f"- result: {len(FORWARD_VARIANTS) + 2} passed" in summary and "- commit: abc123" in summary
    assert "left out: torch eager" in summary
    # the fused probe's smoke run under the interpreter: its report in the summary, a row per variant, this commit
    from bench import fused_probe
    probe = summary[summary.index("## Fused probe"):summary.index("## Logits check")]
    assert "- command: `python -m bench.fused_probe --out " in probe and "- commit: `abc123`" in probe
    assert f"### {fused_probe.SMOKE['shape']}: " in probe and "# The fused path's variants" not in probe
    assert all(f"| {variant.name} | " in probe for variant in fused_probe.VARIANTS)
    assert "- bench 1's geometry pick: " in probe  # from the smoke's CPU times: either way, the dry run goes on
    # the GEMM epilogue probe's smoke run under the interpreter: its report in the summary, every variant checked
    from bench import gemm_epilogue_probe
    epilogue = summary[summary.index("## GEMM epilogue probe"):summary.index("## Logits check")]
    assert "- command: `python -m bench.gemm_epilogue_probe --out " in epilogue and " --smoke --commit abc123`" \
        in epilogue and "# The logits GEMM with the row statistics" not in epilogue
    assert f"### {gemm_epilogue_probe.SMOKE['shape']}: D=40, V=200, 24 rows" in epilogue
    variants = 2 + 2 * len(gemm_epilogue_probe.SMOKE["configs"]) * len(gemm_epilogue_probe.launches(3))
    assert epilogue.count(" | passed |") == variants and "| FAILED |" not in epilogue
    assert "- the forward row pass in the GEMM's epilogue: (d) " in epilogue
    # the fused path's profile, its smoke shape on the CPU: its operators, in the summary
    assert "## Fused-path profile" in summary and "top-level CPU operator (dry run: not a measurement)" in summary
    # ours' default call by tool: the dry run's shapes are none of the targets' (bench.ours_by_tool)
    assert "## Ours' default call, by tool\n\n- no tool timed ours' default call" in summary
    (step,) = [json.loads(line) for line in (out / "train-metrics.jsonl").read_text().splitlines()]
    assert step["rollout_step"] == 1 and "1 steps logged" in summary
    # the bench: its first run at smoke size (torch and Liger), the others' own arguments checked by the bench (--plan)
    (run,) = read_runs(out / "bench.jsonl")
    assert run["meta"]["commit"] == "abc123" and "--smoke" in run["meta"]["command"]
    assert [(r["contender"], r["status"]) for r in run["rows"]][0] == ("torch", "ok")
    assert {r["contender"] for r in run["rows"]} <= {"torch", "liger"}
    commands = {line.split(" | ")[0][2:]: line.rsplit("`", 2)[1] for line in table.splitlines()
                if line.startswith("| bench ")}
    for index, plan in enumerate(gpu_check.BENCH_RUNS[1:], 2):
        command = commands[f"bench {index}: {plan.name}"]
        assert " ".join(plan.arguments(smoke=False)) in command and command.endswith(" --plan"), command
    planned = re.findall(r"^(\d+) rows planned, none run \(--plan\)$", (out / "bench.log").read_text(), re.M)
    assert len(planned) == len(gpu_check.BENCH_RUNS) - 1 and all(int(count) > 0 for count in planned)
    assert "dry run: its arguments checked and its rows listed in bench.log (--plan), none run" in summary
    # bench 1's erpo-epi from the smoke run's JSON (bench.epilogue_pick at its 24 rows against its first config; the
    # CPU's times pick or not, either way): a picked key in bench 1's smoke command, checked by the bench there
    (why,) = re.findall(r"^- bench 1's epilogue pick \(.*?\): (.*)$", epilogue, re.M)
    library = f"{gemm_epilogue_probe.SMOKE['configs'][0]}, grouped"
    assert re.match(rf"(erpo-epi-\S+|none): \(d\) .* at 24 rows, median over the library's \(d\) \({library}\) "
                    r"40x200 \d", why), why
    key = why.split(":")[0]
    assert (f",{key} --progress " in commands[f"bench 1: {gpu_check.BENCH_RUNS[0].name}"]) == (key != "none")
    # the merged table, in the summary without its columns' legend
    assert "| V=1000 | 64 | torch | erpo | ok |" in summary and "### Columns" not in summary
    # its last section, bench.decide's: the dry run's smoke rows and tier decide nothing (the probes' JSON files, read
    # in the work folder, pick or not on the CPU's times; bench 1's candidates run on the fused path only)
    decisions = summary[summary.index("\n## Decisions\n"):]
    verdicts = re.findall(r"^### (.*): \*\*(.*)\*\*$", decisions, re.M)
    assert len(verdicts) == 6 and {verdict for _, verdict in verdicts} == {"cannot decide"}, verdicts
    assert "- read: gemm_epilogue_probe.json, 40x200 24 rows: " in decisions and decisions.endswith("\n\n")
    # the logits stage: logits_gpu_check.sh's dry run, its folder packed, its rows and host table in the summary
    with tarfile.open(out / "logits.tar.gz") as tar:
        assert {"logits/logits.jsonl", "logits/host_cost.md", "logits/profile/profile.md",
                "logits/bench/results.md"} <= set(tar.getnames())
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert_logits_dry_run_results(tmp_path / "unpacked" / "logits", commit="abc123")
    # the stage's own log beside the script's: its command, then all the script printed
    stage_log = (tmp_path / "unpacked" / "logits" / gpu_check.LOGITS_STAGE_LOG).read_text()
    assert stage_log.startswith("$ bash bench/logits_gpu_check.sh --dry-run ") and "logits_gpu_check: commit abc123" \
        in stage_log
    logits = summary[summary.index("## Logits check"):summary.index("## Training")]
    assert "Node tests" not in logits  # the one-node loss's tests run in the kernel tier, not in logits_gpu_check.sh
    assert "| logits | V=1000 | 64 | erpo | ok |" in logits and "| logits | V=1000 | 64 | erpo-log2 | ok |" in logits
    assert "| phase (host us per fwd+bwd, median) | erpo | liger |" in logits
    assert "- profile: erpo: wall " in logits


def assert_logits_dry_run_results(folder: Path, commit: str) -> None:
    """What `bash bench/logits_gpu_check.sh --dry-run FOLDER` (the dry run's logits stage, with COMMIT set) writes: the
    bench rows of ours, the host's microseconds, the kernel profile of ours (and Liger's, or why not) and its log."""
    rows = [json.loads(line)["row"] for line in (folder / "logits.jsonl").read_text().splitlines() if '"row"' in line]
    assert {row["contender"]: row["status"] for row in rows} == {"erpo": "ok", "erpo-log2": "ok"}
    assert (folder / "bench" / "results.md").exists()
    host_cost = json.loads((folder / "host_cost.json").read_text())
    assert host_cost["args"]["device"] == "cpu" and host_cost["results"]["erpo"]["triton_launches"] == 4
    assert host_cost["meta"]["commit"] == commit
    assert "| total |" in (folder / "host_cost.md").read_text()
    profile = json.loads((folder / "profile" / "profile.json").read_text())
    assert profile["meta"]["commit"] == commit  # COMMIT wins over whatever .git the machine's copy holds
    command = profile["meta"]["command"]
    assert profile["meta"]["device"] == "cpu" and command.startswith("python -m bench.kernel_profile --smoke"), command
    assert re.search(r"--out \S+/logits/profile( |$)", command), command
    for key in ("erpo", "erpo-log2"):
        result = profile["results"][key]
        assert result["wall_us"] > 0
        # the loss's forward: one autograd node (`_LogitsLoss`) where nothing traces, the logp/entropy op otherwise
        assert any(name in row["name"] for row in result["kernels"] for name in ("_LogitsLoss", "logp_entropy")), \
            result["kernels"]
    assert isinstance(profile["results"]["liger"], (str, dict))  # "not installed: ..." without its wheel
    markdown = (folder / "profile" / "profile.md").read_text()
    assert "## erpo\n" in markdown and "## liger\n" in markdown
    assert markdown.splitlines()[2:6] == header_lines(profile["meta"])  # bench/provenance.py's header of its meta
    assert f"logits_gpu_check: commit {commit}" in (folder / "logits_gpu_check.log").read_text()


# the stages as they run: the fused path's probes, targets and profile right after the kernel tier, the logits check
# and the training after them, the other bench runs last
RUN_ORDER = (["| kernels", "| probe", "| epilogue", f"| bench 1: {gpu_check.BENCH_RUNS[0].name}", "| profile",
              "| logits", "| train"]
             + [f"| bench {index}: {run.name}" for index, run in enumerate(gpu_check.BENCH_RUNS[1:], 2)])


def fake_run(check, name, command, log_file, limit_s, mirror=None):
    """GpuCheck.run without running: every stage ok but the probe, which fails (the stages' commands run in the dry
    run's test)."""
    failed = name == "probe"
    stage = gpu_check.Stage(name, command, limit_s, exit_code=int(failed), status="failed" if failed else "ok")
    check.stages.append(stage)
    return stage


def test_a_failing_probe_is_reported_and_the_later_stages_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check.GpuCheck, "run", fake_run)
    assert gpu_check.main(["--dry-run", str(tmp_path)]) == 1
    summary = (tmp_path / "summary.md").read_text()
    table = summary[:summary.index("## Kernel tier")]
    assert [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ") and "| exit |" not in line
            and not line.startswith("|---")] == RUN_ORDER
    assert "| probe | failed | " in table and table.count(" | ok | ") == len(RUN_ORDER) - 1
    probe = summary[summary.index("## Fused probe"):summary.index("## Logits check")]
    assert "(no report: not run, failed or stopped; what it printed is in bench.log)" in probe


def test_the_probe_runs_both_target_shapes_at_the_target_size(check, monkeypatch):
    commands = []

    def run(name, command, log, limit_s):
        commands.append((command, log, limit_s))
        return gpu_check.Stage(name, command, limit_s, exit_code=0, status="ok")
    monkeypatch.setattr(check, "run", run)
    monkeypatch.setattr(check, "dry_run", False)
    monkeypatch.setattr(check, "commit", "abc123")
    check.probe()
    ((command, log, limit_s),) = commands
    assert command[1:3] == ["-m", "bench.fused_probe"] and "--smoke" not in command
    assert " --shapes qwen2.5-7b,qwen2.5-32b --n 16384 --commit abc123" in " ".join(command)
    assert log.name == "bench.log" and limit_s == gpu_check.PROBE_LIMIT_S  # one of the 8 files


def test_the_epilogue_probe_runs_both_target_shapes_at_two_chunk_sizes(check, monkeypatch):
    commands = []

    def run(name, command, log, limit_s):
        commands.append((name, command, log, limit_s))
        return gpu_check.Stage(name, command, limit_s, exit_code=0, status="ok")
    monkeypatch.setattr(check, "run", run)
    monkeypatch.setattr(check, "dry_run", False)
    monkeypatch.setattr(check, "commit", "abc123")
    check.epilogue()
    ((name, command, log, limit_s),) = commands
    assert name == "epilogue" and command[1:3] == ["-m", "bench.gemm_epilogue_probe"] and "--smoke" not in command
    assert " --shapes qwen2.5-7b,qwen2.5-32b --rows 512,2048 --commit abc123" in " ".join(command)
    assert log.name == "bench.log" and limit_s == gpu_check.EPILOGUE_LIMIT_S  # one of the 8 files


def test_the_fused_stages_at_their_limits_leave_the_profile_its_measured_time():
    """The schedule's worst case (bench/gpu_check.py): the kernel tier, both probes and bench 1 with the probe's pick
    at their limits, after the setup's second, leave the fused profile the 12 s it took on the H200 at e17ad62, and
    at least the time a stage needs to be started."""
    first = (1 + gpu_check.KERNEL_LIMIT_S + gpu_check.PROBE_LIMIT_S + gpu_check.EPILOGUE_LIMIT_S
             + gpu_check.BENCH_RUNS[0].cap_s + gpu_check.PICKED_CAP_S)
    assert first + max(12, gpu_check.MIN_STAGE_S) <= gpu_check.DEADLINE_S - gpu_check.SUMMARY_RESERVE_S
    assert gpu_check.STAGES.index("profile") == gpu_check.STAGES.index("epilogue") + 1


@pytest.mark.parametrize("stages, probe_status, ratio, picked", [
    ("probe,bench", "ok", 0.96, "erpo-geom-256-2304"),  # faster than the library default on both shapes
    ("probe,bench", "ok", (0.9, 1.01), None),  # on one only
    ("probe,bench", "failed", 0.96, None),  # its results are not read
    ("bench", None, None, None)])  # the probe did not run
def test_bench_1_times_the_probe_s_pick_beside_ours_and_torch_compile(tmp_path, monkeypatch, stages, probe_status,
                                                                      ratio, picked):
    """The dry run's bench 1 command (its smoke, the pick in --contenders) and limit with and without the probe's
    pick (bench.probe_pick), the pick or why none in the summary; the GPU run's bench 1 arguments with it."""
    from test_probe_pick import write_probe

    def run(check, name, command, log_file, limit_s, mirror=None):  # the probe writes its results, nothing runs
        if name == "probe":
            folder = Path(command[command.index("--out") + 1])
            folder.mkdir(parents=True)
            write_probe(folder, {"chunk rows 256, group 2304": ratio})
        stage = gpu_check.Stage(name, command, limit_s, exit_code=0, status=probe_status or "ok")
        check.stages.append(stage)
        return stage
    monkeypatch.setattr(gpu_check.GpuCheck, "run", run)
    gpu_check.main(["--dry-run", "--stages", stages, str(tmp_path)])
    summary = (tmp_path / "summary.md").read_text()
    (line,) = [line for line in summary.splitlines() if line.startswith("| bench 1: ")]
    cells = line.split(" | ")
    contenders = gpu_check.DRY_RUN_CONTENDERS + (f",{picked}" if picked else "")
    assert f" --smoke --paths logits --contenders {contenders} --progress " in cells[-1]
    first = gpu_check.BENCH_RUNS[0]
    assert float(cells[3]) == first.cap_s + (gpu_check.PICKED_CAP_S if picked else 0)
    why = {"ok": "erpo-geom-256-2304: 'chunk rows 256, group 2304'" if picked else "none: 'chunk rows 256, group",
           "failed": "none: the probe failed", None: "none: the probe did not run"}[probe_status]
    assert f"- bench 1's geometry pick: {why}" in summary
    assert (f"- bench 1: {first.name}: with the probe's pick {picked}" in summary) == bool(picked)
    if picked:  # on the GPU: the fused targets' run with the candidate last, which the bench accepts
        arguments = replace(first, picked=picked).arguments(smoke=False)
        assert arguments[arguments.index("--contenders") + 1] == f"{first.contenders},{picked}"
        from bench.__main__ import main as bench_main
        assert bench_main([*arguments, "--out", str(tmp_path / "plan"), "--plan"]) == 0


@pytest.mark.parametrize("status, ratio, picked", [
    ("ok", 0.9, "erpo-epi-128x128x64-w4-s4-persistent132-tma"),  # faster than the library's on both shapes
    ("time limit", 0.9, "erpo-epi-128x128x64-w4-s4-persistent132-tma"),  # its 512-row chunks finished
    ("ok", (0.9, 1.01), None),  # on one only: erpo-epi at the library's config
    ("failed", 0.9, None)])  # its results are not read
def test_bench_1_times_erpo_epi_at_the_epilogue_probe_s_pick(check, monkeypatch, status, ratio, picked):
    """On the GPU, the epilogue probe's pick (bench.epilogue_pick) takes erpo-epi's place in bench 1's contenders,
    no other contender and no other cap, with the geometry pick beside it; the summary says which and why, or why
    none; the bench accepts the command."""
    from test_epilogue_pick import PERSISTENT_TMA, write_probe
    commands = []

    def run(name, command, log_file, limit_s, mirror=None):  # the probe writes its results, nothing runs
        if name == "epilogue":
            folder = Path(command[command.index("--out") + 1])
            folder.mkdir(parents=True)
            write_probe(folder, {PERSISTENT_TMA: ratio}, rows=(512,) if status == "time limit" else (512, 2048))
        commands.append((name, command, limit_s))
        stage = gpu_check.Stage(name, command, limit_s, exit_code=0, status=status if name == "epilogue" else "ok")
        check.stages.append(stage)
        return stage
    monkeypatch.setattr(check, "run", run)
    monkeypatch.setattr(check, "dry_run", False)
    check.pick = gpu_check.Pick("erpo-geom-256", "erpo-geom-256: the fused probe's")
    check.epilogue()
    check.bench(range(1, 2))
    check.write_summary()
    (_, command, limit_s), first = commands[-1], gpu_check.BENCH_RUNS[0]
    contenders = first.contenders.replace("erpo-epi", picked or "erpo-epi") + ",erpo-geom-256"
    assert command[command.index("--contenders") + 1] == contenders and contenders.count("erpo-epi") == 1
    assert limit_s == first.cap_s + gpu_check.PICKED_CAP_S  # the geometry's time alone
    summary = (check.out / "summary.md").read_text()
    (why,) = re.findall(r"^- bench 1's epilogue pick \(erpo-epi's place; none: erpo-epi at the library's config and "
                        r"launch\): (.*)$", summary, re.M)
    if picked:
        assert why.startswith(f"{picked}: (d) 128x128x64 w4 s4, persistent (132), TMA") and why.endswith("every shape")
        assert f"erpo-epi at the epilogue probe's pick: {picked} in its place" in summary
        from bench.__main__ import main as bench_main
        arguments = command[command.index("--n"):command.index("--progress")]
        assert bench_main([*arguments, "--out", str(check.work / "plan"), "--plan"]) == 0
    elif status == "failed":
        assert why == "none: the epilogue probe failed" and "in its place" not in summary
    else:
        assert why.startswith("none: (d) 128x128x64 w4 s4") and why.endswith("not faster than the library's on every "
                                                                               "shape")
        assert "in its place" not in summary


def test_stages_runs_only_the_stages_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.GpuCheck, "run", fake_run)
    assert gpu_check.main(["--dry-run", "--stages", "kernels", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert [line.split(" | ")[0] for line in summary.splitlines() if line.startswith("| ") and " | ok | " in line] \
        == ["| kernels"]
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--stages", "kernels,benhc", str(tmp_path)])
    expected = ("--stages: expected a comma list of kernels, probe, epilogue, profile, logits, train, bench, got "
                "'kernels,benhc'")
    assert expected in capsys.readouterr().err


@pytest.fixture
def check(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "MIN_STAGE_S", 1)
    check = gpu_check.GpuCheck(tmp_path, dry_run=True, commit=None)
    yield check
    shutil.rmtree(check.work)


def merge_in_place_of(tmp_path, monkeypatch, script: str) -> Path:
    """An interpreter for the bench merge that runs the shell `script` whatever its arguments (the merge's command
    line in `$@`), and a bench.jsonl for it to merge."""
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    (tmp_path / "bench.jsonl").write_text("")
    return fake


@pytest.mark.parametrize("stage_limit_s,limit", [(None, gpu_check.SUMMARY_RESERVE_S),
                                                   (gpu_check.DRY_RUN_STAGE_LIMIT_S, gpu_check.DRY_RUN_STAGE_LIMIT_S)])
def test_the_bench_merge_has_the_summary_s_reserve_and_in_the_dry_run_the_stages_ceiling(tmp_path, monkeypatch,
                                                                                      stage_limit_s, limit):
    """On a GPU the merge runs within the summary's reserve; the dry run gives it its stages' ceiling (a loaded CPU
    took the 25 s reserve to import the merge, and the dry run ended in its TimeoutExpired)."""
    merge_in_place_of(tmp_path, monkeypatch, 'echo "$@"')
    dry_run = stage_limit_s is not None
    check = gpu_check.GpuCheck(tmp_path, dry_run, commit=None, stage_limit_s=stage_limit_s,
                               deadline_s=gpu_check.DRY_RUN_DEADLINE_S if dry_run else gpu_check.DEADLINE_S)
    check.merge_bench()
    [stage] = check.stages
    assert (stage.name, stage.status, stage.limit_s) == ("bench merge", "ok", limit)
    assert stage.command[1:4] == ["-m", "bench", "--merge"]
    assert f"-m bench --merge {tmp_path / 'bench.jsonl'} --out " in (tmp_path / "bench.log").read_text()
    shutil.rmtree(check.work)


def test_a_bench_merge_past_its_limit_is_a_stage_stopped_at_its_time_limit_not_a_traceback(tmp_path, monkeypatch,
                                                                                         capsys):
    """On an H200 lease the merge (then a subprocess.run within the summary's reserve) ran past it and gpu_check
    ended in TimeoutExpired's traceback: now it is stopped as any stage is, one line, its row in the table, and the
    check goes on to its summary (exit 1: a stage not ok)."""
    merge_in_place_of(tmp_path, monkeypatch, "exec sleep 600")
    monkeypatch.setattr(gpu_check, "SUMMARY_RESERVE_S", 1)   # the merge's limit; MIN_STAGE_S: a stage that short runs
    monkeypatch.setattr(gpu_check, "MIN_STAGE_S", 0)
    monkeypatch.setattr(gpu_check, "STAGES", ("bench",))
    monkeypatch.setattr(gpu_check.GpuCheck, "bench", lambda check, numbers: None)
    assert gpu_check.main(["--stages", "bench", str(tmp_path)]) == 1
    log = (tmp_path / "gpu_check.log").read_text()
    [line] = [line for line in log.splitlines() if "] bench merge: " in line and ": limit " not in line]
    assert line.endswith(f"] bench merge: time limit (exit {-signal.SIGTERM}) after 1 s"), line
    assert "Traceback" not in log + capsys.readouterr().err
    table = (tmp_path / "summary.md").read_text()
    assert re.search(r"^\| bench merge \| time limit \| 1 \| 1 \| -15 \| ", table, re.M), table
    assert "[gpu_check] stopped at the stage's time limit (1 s)" in (tmp_path / "bench.log").read_text()


def gone_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` has ended within `seconds`: no such process, or a zombie (ended, not yet reaped by
    whichever process inherited it; a killed process also takes a moment to end on a busy machine)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_stage_past_its_limit_is_stopped_with_its_children(check, tmp_path):
    child = tmp_path / "child.pid"
    script = f"sleep 60 & echo $! > {child}; echo begun; wait"
    begin = time.monotonic()
    stage = check.run("sleepy", ["bash", "-c", script], tmp_path / "sleepy.log", limit_s=3)
    assert stage.status == "time limit" and stage.exit_code is not None and time.monotonic() - begin < 20
    log = (tmp_path / "sleepy.log").read_text()
    assert "begun" in log and "stopped at the stage's time limit (3 s)" in log
    assert gone_within(int(child.read_text()), seconds=10)  # the stage's own child went with it
    assert "| sleepy | time limit |" in (tmp_path / "summary.md").read_text()


def test_the_dry_run_holds_a_stage_to_its_cpu_ceiling_not_to_its_gpu_limit(tmp_path, monkeypatch):
    """A dry run's stage that outlasts its GPU limit (a CPU shared by other test suites is slower than any lease)
    runs to its end: the dry run's stages get DRY_RUN_STAGE_LIMIT_S, for a hung stage only."""
    def kernels(check):  # a stage of 2 s under a GPU limit of 1 s
        check.run("kernels", ["bash", "-c", f"sleep 2; touch {tmp_path / 'ended'}"], check.out / "kernel-tests.log",
                  limit_s=1)
    monkeypatch.setattr(gpu_check, "MIN_STAGE_S", 0)
    monkeypatch.setattr(gpu_check.GpuCheck, "kernels", kernels)
    assert gpu_check.main(["--dry-run", "--stages", "kernels", str(tmp_path / "out")]) == 0
    assert (tmp_path / "ended").exists()
    (row,) = [line for line in (tmp_path / "out" / "summary.md").read_text().splitlines()
              if line.startswith("| kernels | ")]
    assert row.split(" | ")[1] == "ok" and float(row.split(" | ")[3]) == gpu_check.DRY_RUN_STAGE_LIMIT_S, row


@pytest.mark.parametrize("stage_ends", ["at its time limit", "in an exception"])
def test_the_clocks_are_sampled_over_the_lease_and_stopped_whatever_the_stages_do(tmp_path, monkeypatch, stage_ends):
    """With nvidia-smi on PATH (a fake: tests/repo/test_gpu_clocks.py), gpu_check starts its loop before the first
    stage and ends it after the last, also when that stage is stopped at its limit or gpu_check itself fails; the
    stage's row gets its samples' clocks, temperature, power and the sw power cap the fake reports."""
    from test_gpu_clocks import fake_smi

    folder = fake_smi(tmp_path / "bin", monkeypatch)
    monkeypatch.setattr(gpu_check, "MIN_STAGE_S", 1)
    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path / "no-wheels")

    def kernels(check):  # a stage that outlasts its 3 s, or breaks gpu_check
        check.run("kernels", ["bash", "-c", "sleep 60"], check.out / "kernel-tests.log", limit_s=3)
        if stage_ends == "in an exception":
            raise RuntimeError("a bug in gpu_check")
    monkeypatch.setattr(gpu_check.GpuCheck, "kernels", kernels)
    out = tmp_path / "out"
    if stage_ends == "in an exception":
        with pytest.raises(RuntimeError):
            gpu_check.main(["--stages", "kernels", str(out)])
    else:
        assert gpu_check.main(["--stages", "kernels", str(out)]) == 1
    assert gone_within(int((folder / "smi.pid").read_text()), seconds=1)  # stopped and waited for: no orphan
    log = (out / "gpu_check.log").read_text()
    assert re.search(r"clocks: sampled every 100 ms into clocks\.csv \(timestamp, .*\); \d+ samples, the loop's exit 0",
                     log), log
    summary = (out / "summary.md").read_text()
    assert "- clocks: sampled every 100 ms" in summary and gpu_clocks.LEGEND in summary
    (row,) = [line for line in summary.splitlines() if line.startswith("| kernels | time limit |")]
    cells = row.split(" | ")
    assert cells[5:9] == ["1755", "1755", "58", "612"] and re.fullmatch(r"sw power cap \((\d+) of \1\)", cells[9])


# gpu_check in a process of its own (what the device tool or a user signals): its kernel stage a shell whose child
# sleeps, which writes that child's pid once started; the training stage a command that leaves a file if it starts;
# no wheels; the fake nvidia-smi's loop ten samples a second (test_gpu_clocks.fake_smi)
SIGNALLED_CHECK = """
import sys
from pathlib import Path
from bench import gpu_check, gpu_clocks

def kernels(check):
    script = "sleep 600 & echo $! > {child}.tmp && mv {child}.tmp {child}; wait"
    check.run("kernels", ["bash", "-c", script], check.out / "kernel-tests.log", limit_s=300)

def train(check):
    check.run("train", ["touch", {trained!r}], check.out / "gpu_check.log", limit_s=300)

gpu_check.GpuCheck.kernels, gpu_check.GpuCheck.train = kernels, train
gpu_check.WHEELS = Path({no_wheels!r})
gpu_clocks.INTERVAL_MS = 100
sys.exit(gpu_check.main(["--stages", "kernels,train", {out!r}]))
"""


def wait_for_pid(path: Path, process: subprocess.Popen, seconds: float = 60) -> int:
    """The pid a process writes into `path` (whole: the writer renames it into place, or writes a few bytes at once),
    once it is there; fails if `process` (the one that starts the writer) ends first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists() and path.read_text().strip().isdigit():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"no pid in {path} (gpu_check's exit: {process.poll()})")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_gpu_check_stops_the_stage_and_the_clocks_and_writes_the_summary(tmp_path, monkeypatch, signum):
    """SIGTERM (the device tool's timeout, kill) or SIGINT (Ctrl+C) to gpu_check while a stage runs: the stage's
    process group (a session of its own, which the signal does not reach) is stopped, no later stage starts, the clock
    sampler is stopped, the summary says so, and gpu_check exits 128 + the signal's number, as a shell reports it.
    Python's default would end it on SIGTERM without its `finally`, leaving the stage's child and nvidia-smi running."""
    from test_gpu_clocks import fake_smi

    smi = fake_smi(tmp_path / "bin", monkeypatch)
    out, child, trained = tmp_path / "out", tmp_path / "child.pid", tmp_path / "trained"
    script = SIGNALLED_CHECK.format(child=child, trained=str(trained), no_wheels=str(tmp_path / "no-wheels"),
                                    out=str(out))
    with open(tmp_path / "gpu_check.out", "w") as output:
        process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
    pids = []
    try:
        pids = [wait_for_pid(child, process), wait_for_pid(smi / "smi.pid", process)]  # the stage and the sampler run
        process.send_signal(signum)
        assert process.wait(timeout=60) == 128 + signum, (tmp_path / "gpu_check.out").read_text()[-3000:]
        assert gone_within(pids[0], seconds=10)  # the stage's child, with its group
        assert gone_within(pids[1], seconds=1)   # the sampler was stopped and waited for before gpu_check ended
    finally:  # nothing left behind if the test fails
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
    name = signal.Signals(signum).name
    assert (out / "kernel-tests.log").read_text().endswith(f"\n[gpu_check] stopped: gpu_check got {name}\n")
    assert not trained.exists()
    summary = (out / "summary.md").read_text()
    assert f"- stopped: gpu_check got {name}; the stage then running was stopped" in summary
    assert re.search(rf"^\| kernels \| stopped \({name}\) \| \d+ \| 300 \| -?\d+ \| ", summary, re.M), summary
    assert "| train | not run |" in summary and f"- train: not started: gpu_check got {name}" in summary
    log = (out / "gpu_check.log").read_text()
    assert re.search(r"clocks: sampled every 100 ms .*; \d+ samples, the loop's exit ", log), log  # stop() ran
    assert f"(stopped: gpu_check got {name})" in log.splitlines()[-1]


def test_main_puts_the_signal_handlers_back_also_after_an_exception(tmp_path, monkeypatch):
    """main() also runs inside pytest (these tests): the SIGTERM and SIGINT handlers it installs for its stages are
    the previous ones again when it returns, and when a stage raises; its summary is written either way."""
    before = {sig: signal.getsignal(sig) for sig in gpu_check.STOP_SIGNALS}
    monkeypatch.setattr(gpu_check.GpuCheck, "run", fake_run)
    assert gpu_check.main(["--dry-run", "--stages", "kernels", str(tmp_path / "ok")]) == 0
    assert {sig: signal.getsignal(sig) for sig in gpu_check.STOP_SIGNALS} == before

    def kernels(check):
        raise RuntimeError("a bug in gpu_check")
    monkeypatch.setattr(gpu_check.GpuCheck, "kernels", kernels)
    with pytest.raises(RuntimeError, match="a bug in gpu_check"):
        gpu_check.main(["--dry-run", "--stages", "kernels", str(tmp_path / "raised")])
    assert {sig: signal.getsignal(sig) for sig in gpu_check.STOP_SIGNALS} == before
    assert (tmp_path / "raised" / "summary.md").exists()


def test_no_stage_starts_past_the_deadline(check, tmp_path):
    check.deadline_s = gpu_check.SUMMARY_RESERVE_S
    stage = check.run("late", ["bash", "-c", f"touch {tmp_path / 'ran'}"], tmp_path / "late.log", limit_s=60)
    assert stage.status == "not run" and not (tmp_path / "ran").exists()
    assert "not started" in stage.notes[0]


def test_a_failing_stage_is_reported_and_the_next_one_runs(check, tmp_path):
    first = check.run("broken", ["bash", "-c", "exit 3"], tmp_path / "a.log", limit_s=30)
    second = check.run("fine", ["bash", "-c", "true"], tmp_path / "b.log", limit_s=30)
    assert (first.status, first.exit_code) == ("failed", 3) and (second.status, second.exit_code) == ("ok", 0)
    # each command as a shell takes it, in its log and in the summary (the kernel tier's `-m 'not cpu_only'`)
    assert (tmp_path / "a.log").read_text().splitlines()[0] == "$ bash -c 'exit 3'"
    summary = (tmp_path / "summary.md").read_text()
    assert "| broken | failed | 0 | 30 | 3 | - | - | - | - | - | `bash -c 'exit 3'` |" in summary  # no clocks sampled


def test_the_bench_runs_cover_every_contender_at_every_n_but_the_one_left_out():
    from bench.__main__ import parse_args
    from bench.contenders import CONTENDER_KEYS, select

    planned = set()
    for run in gpu_check.BENCH_RUNS:
        args = parse_args(run.arguments(smoke=False) + ["--out", "unused"])
        keys = set(args.contenders.split(",")) - set(filter(None, args.skip.split(",")))
        assert keys <= set(CONTENDER_KEYS) and args.budget == 2
        kept = {c.key for c in select(keys, args.paths.split(","))}  # a contender only on a path not run: none
        planned |= {(int(n), key) for n in args.n.split(",") for key in kept}
    every = {(n, key) for n in (4096, 16384, 65536) for key in CONTENDER_KEYS}
    # erpo-dh32 (d hidden held in fp32) and erpo-epi (the row pass in the GEMM's epilogue) are bench 1's alone so far:
    # the defaults they decide are judged at N=16384 (bench/README.md, "Deciding d hidden's dtype" and "Deciding the
    # epilogue row pass"); a run at N=65536 is the schedule's to add
    assert every - planned == {(65536, "torch"), (65536, "erpo-dh32"), (65536, "erpo-epi")} and planned <= every
    assert [run.left_out.split(" ")[0] for run in gpu_check.BENCH_RUNS if run.left_out] == ["torch"]
    # the first run: the fused path's targets, ours (with the default and a 2 GiB workspace, with d hidden held in
    # fp32, and with the row pass in the GEMM's epilogue) beside torch.compile and Liger, the target size first
    first = parse_args(gpu_check.BENCH_RUNS[0].arguments(smoke=False) + ["--out", "unused"])
    assert (first.paths, first.n, first.contenders) == ("fused", "16384,4096",
                                                        "erpo,erpo-ws2g,erpo-dh32,erpo-epi,compile,liger")


def test_the_kernel_tier_runs_on_workers_under_a_session_timeout(check, monkeypatch):
    """On the GPU image (pytest-timeout 2.5.0, pytest-xdist 3.8.0): the tier's workers, each test's limit and the
    session's, which ends the tier with its result line before the stage's own limit kills it; its cpu_only tests
    left out, every file of the tier given, the slowest first, in an order xdist keeps."""
    commands = []
    monkeypatch.setattr(check, "run", lambda name, command, log, limit_s: commands.append((command, limit_s)))
    monkeypatch.setattr(check, "dry_run", False)
    versions = {"pytest-timeout": (2, 5), "pytest-xdist": (3, 8)}
    monkeypatch.setattr(gpu_check, "_version", lambda name: versions[name])
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: name == "xdist")
    check.kernels()
    ((command, limit_s),) = commands
    flags = " ".join(command[3:])
    assert f"-n {gpu_check.KERNEL_WORKERS} --dist loadfile --no-loadscope-reorder" in flags
    assert "-rfE --tb=short" in flags and "-q" not in command  # the header: plugins, limits, the tests collected
    assert f"--timeout {gpu_check.KERNEL_TEST_TIMEOUT_S} --session-timeout {gpu_check.KERNEL_SESSION_S}" in flags
    assert command[command.index("-m", 3) + 1] == "not cpu_only" and limit_s == gpu_check.KERNEL_LIMIT_S
    first = [f"tests/kernels/{name}" for name in gpu_check.KERNEL_FILES_FIRST]
    files = command[command.index(first[0]):]
    assert files[:len(first)] == first
    assert sorted(files) == sorted(f"tests/kernels/{path.name}" for path in (REPO / "tests/kernels").glob("test_*.py"))
    # a test started as the session ends (its clock starts in each worker, after the imports), stopped at its limit,
    # leaves time for the report
    assert gpu_check.KERNEL_SESSION_S + gpu_check.KERNEL_TEST_TIMEOUT_S + 15 <= gpu_check.KERNEL_LIMIT_S
    assert check.env["COLUMNS"] == gpu_check.WIDE_COLUMNS  # the failures' messages uncut
    commands.clear()
    versions["pytest-xdist"] = (3, 7)  # before --no-loadscope-reorder: xdist's own order, the tier still whole
    check.kernels()
    ((command, _),) = commands
    assert "--no-loadscope-reorder" not in command and "--dist" in command


def test_the_files_first_exist_and_the_bench_smoke_run_stays_off_the_gpu():
    """KERNEL_FILES_FIRST names files of the tier; every test of the bench smoke's run (its module fixture took 132 s
    of the tier on the H200, 2026-11-27) is cpu_only, which the GPU lease's tier leaves out."""
    import ast

    assert all((REPO / "tests/kernels" / name).is_file() for name in gpu_check.KERNEL_FILES_FIRST)
    tree = ast.parse((REPO / "tests/kernels/test_bench_smoke.py").read_text())
    smoke_tests = {node.name: {ast.unparse(mark) for mark in node.decorator_list} for node in tree.body
                   if isinstance(node, ast.FunctionDef) and "smoke" in [arg.arg for arg in node.args.args]}
    assert len(smoke_tests) >= 8 and all("pytest.mark.cpu_only" in marks for marks in smoke_tests.values())


def test_the_tier_leaves_the_cpu_work_to_ci_and_starts_its_slowest_cuda_files_first():
    """The tier's tests as the lease's command selects them (`-m KERNEL_MARKS` on kernel_files()): none of the sm_90
    compile checks (a cross-compile on the CPU whatever the machine, 122 s of the H200's tier at e17ad62: CI runs
    them), while each file that starts first holds tests that run there, and kernel_files() gives those files first,
    in KERNEL_FILES_FIRST's order, then every other file once."""
    env = dict(os.environ, TRITON_INTERPRET="1")  # collected as CI collects it, on a machine with a GPU too
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                           gpu_check.KERNEL_MARKS, *gpu_check.kernel_files()], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    selected = {}
    for line in done.stdout.splitlines():
        if "::" in line:
            path = line.split("::")[0]
            selected[path] = selected.get(path, 0) + 1
    compile_checks = sorted(path.relative_to(REPO).as_posix()
                            for path in (REPO / "tests/kernels").glob("test_compile_hopper*.py"))
    assert len(compile_checks) == 2 and not set(compile_checks) & set(selected), selected
    first = [f"tests/kernels/{name}" for name in gpu_check.KERNEL_FILES_FIRST]
    assert all(selected.get(path, 0) > 0 for path in first), {path: selected.get(path, 0) for path in first}
    files = gpu_check.kernel_files()
    assert files[:len(first)] == first and len(set(files)) == len(files)
    assert set(selected) < set(files)  # every file whose tests run on CUDA is in the command


def test_the_kernel_summary_names_each_failure_with_its_message_and_an_early_stop():
    """The lines pytest (9, xdist 3.8, pytest-timeout 2.5) printed for a tier stopped by its session timeout: with
    tests not yet started, counted, or after its last test, which ended past the session's end."""
    log = ["created: 12/12 workers", "12 workers [12 items]", "", "....FF....", "=== short test summary info ===",
           "FAILED tests/kernels/test_x.py::test_d[a] - AssertionError: response_logp",
           "ERROR tests/kernels/test_bench_smoke.py::test_writes_all_outputs - Failed: Timeout (>180.0s) from "
           "pytest-timeout.",
           "!!!!!!!!!! xdist.dsession.Interrupted: session-timeout: 150.0 sec exceeded !!!!!!!!!!",
           "========== 1 failed, 8 passed, 1 error in 161.40s (0:02:41) ==========",
           "12.01s setup    tests/kernels/test_bench_smoke.py::test_writes_all_outputs"]
    assert gpu_check.pytest_summary(log) == [
        "- result: 1 failed, 8 passed, 1 error in 161.40s (0:02:41) (of 12 collected)",
        "- stopped early: xdist.dsession.Interrupted: session-timeout: 150.0 sec exceeded (the tests not yet started "
        "did not run: 2 of them)",
        "- FAILED tests/kernels/test_x.py::test_d[a] - AssertionError: response_logp",
        "- ERROR tests/kernels/test_bench_smoke.py::test_writes_all_outputs - Failed: Timeout (>180.0s) from "
        "pytest-timeout.",
        "- slow: `12.01s setup    tests/kernels/test_bench_smoke.py::test_writes_all_outputs`"]
    log[1] = "12 workers [10 items]"
    assert gpu_check.pytest_summary(log)[1] == ("- stopped early: xdist.dsession.Interrupted: session-timeout: 150.0 "
                                                "sec exceeded (after every collected test had run)")
    assert gpu_check.pytest_summary(["....", "[gpu_check] stopped at the stage's time limit (210 s)"]) == [
        "- result: no result line (stopped?)"]


def test_the_logits_summary_points_to_the_stage_s_log_where_the_script_s_is_missing(tmp_path):
    """A logits stage whose script wrote no log of its own (it failed before its log began, or was stopped then): the
    summary sends the reader to the stage's log in logits.tar.gz, and says "not run" only where neither exists."""
    assert gpu_check.logits_summary(tmp_path) == ["(not run)"]
    (tmp_path / gpu_check.LOGITS_STAGE_LOG).write_text("$ bash bench/logits_gpu_check.sh\nsyntax error\n")
    assert gpu_check.logits_summary(tmp_path) == [
        f"(no logits_gpu_check.log: what the stage printed is {gpu_check.LOGITS_STAGE_LOG} in logits.tar.gz)"]


def test_a_deadline_too_short_for_one_stage_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--dry-run", "--deadline", str(gpu_check.SUMMARY_RESERVE_S), str(tmp_path / "out")])
    assert stop.value.code == 2 and "--deadline: at least" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any folder or file is made
