"""`bash bench/gpu_check.sh [--dry-run] [--commit HASH] [--stages LIST] [OUT_DIR]`: what one short GPU lease
measures, in one command that ends within 9 minutes (bench/README.md, "One command for a GPU lease").

Stages, in this order, each a subprocess in its own process group under its own time limit (the group is killed at
the limit, so a slow stage cannot take the next one's time), each writing its results as it goes:

1. kernels: the kernel test tier (`tests/kernels`) on CUDA, with every test's duration; pytest-timeout (in the GPU
   image) stops a hung test and the tier goes on.
2. train: `erpo train`, the built-in tiny default, for 20 rollout steps on CUDA with the plain-torch updater
   (DeepSpeed, which trainer.updater=auto picks on CUDA, is not in the GPU image).
3. profile: `python -m bench.kernel_profile --path fused` at N=16384 on the Qwen2.5-7B lm_head: the fused path's
   kernels one by one and where the GPU idles between them (waiting for the host, per next kernel, the largest
   gaps, the host's syncs), copied into summary.md (its output goes to bench.log).
4. bench: `python -m bench` runs (BENCH_RUNS), most wanted first, all appending to one --progress file; each gets
   what is left before the deadline, up to its own cap. What a run did not reach is in the table as `not reached`.

Then the table merged from the progress file and a summary. The files (8, the device tool's limit) under OUT_DIR:
summary.md, gpu_check.log (environment, wheel install, each stage's command, limit, time, exit), kernel-tests.log,
train.log, train-metrics.jsonl, bench.log, bench.jsonl (`python -m bench --merge` reads it) and bench-results.md.

`--dry-run` (CI: tests/repo/test_gpu_check.py) runs the same stages on the CPU under the Triton interpreter, shrunk:
the device-fixture guard and one Triton kernel test for the tier, one tiny training step, the fused-path profile's
smoke shape (the CPU's operators, no gaps), the bench's smoke shape (logits path, torch and Liger only); no wheels
are installed, so missing peers are reported and skipped.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 540            # the whole command: 9 minutes, inside the device tool's 10-minute limit per call
SUMMARY_RESERVE_S = 25      # kept back from the stages for the merge and the summary
MIN_STAGE_S = 15            # a stage with less time left than this is not started
KERNEL_TIER = "tests/kernels"
# The limits come from this command's 2026-11-25 run on an H200 (commit fd4ea16; its files are in
# bench/measured/h200-2026-11-25/, the stage times in gpu_check.log there): each stage's measured time plus about a
# fifth, so that the peers get what the measured stages leave.
KERNEL_LIMIT_S = 150        # measured 126 s (issue 31 asks at most 3 minutes)
KERNEL_TEST_TIMEOUT_S = 90  # one test (pytest-timeout), so that one hung test does not cost the tier
KERNEL_WORKERS = 4          # pytest-xdist processes sharing the GPU: compiles, autotuning and CPU-only tests overlap
TRAIN_LIMIT_S = 65          # measured 51 s
TRAIN_STEPS = 20
PROFILE_LIMIT_S = 45        # the fused path's profile at N=16384 ran in 25 s on the H200 at a550ecf (bench/RESULTS.md)
DRY_RUN_CONTENDERS = "torch,liger"
# the tier's device guard and one Triton kernel test (a single row: seconds in the interpreter)
DRY_RUN_KERNEL_TESTS = (f"{KERNEL_TIER}/test_device_guard.py",
                        f"{KERNEL_TIER}/test_triton_logits.py::test_target_gradient_exact_in_bf16")
STAGES = ("kernels", "train", "profile", "bench")  # in the order they run (--stages picks some)
WHEELS = REPO / ".whl"       # liger-kernel, cut-cross-entropy, math-verify and its two needs (bench/README.md)


@dataclass
class BenchRun:
    """One `python -m bench` run of the bench stage: rows N, contenders kept / left out, and why some are left out."""

    name: str
    n: str
    cap_s: float
    contenders: str | None = None
    skip: tuple = ()
    left_out: str = ""

    def arguments(self, dry_run: bool) -> list:
        skip = ["--skip", ",".join(self.skip)] if self.skip else []
        if dry_run:  # the smoke shape on the CPU, logits path, the quick contenders (the interpreter and Inductor's
            # C++ builds take minutes there; tests/kernels/test_bench_smoke.py runs them)
            return ["--smoke", "--paths", "logits", "--contenders", DRY_RUN_CONTENDERS, *skip]
        return ["--n", self.n, "--budget", "2"] + (["--contenders", self.contenders] if self.contenders else []) + skip


# Most wanted first. On the 2026-11-25 H200 run, "ours" took 78 s; every peer at N=16384 and 4096 in one run (torch
# eager first at each case, in bench/contenders.py's order) passed its 200 s cap with 2 rows left, and N=65536 then
# had 56 s, not enough for its first row: 12 rows not reached. So the peers the targets name (issue 32: Liger's
# triton_grpo_loss on the logits path, torch.compile on the fused path) run first, at the target size N=16384 first;
# then N=65536; the other peers (the batch-invariant variant, torch eager, CCE, and any new contender) last. That
# run's files hold no per-row times, so the caps of bench 2 and 3 split what the measured stages leave (about 260 s)
# roughly by their rows.
BENCH_RUNS = (
    # ours with each forward-kernel variant side by side (bench/contenders.py), so one lease picks the variant
    BenchRun("ours at every N", "4096,16384,65536", cap_s=95, contenders="erpo,erpo-warp-1024,erpo-log2-2048"),
    BenchRun("the targets' peers at N=16384 and 4096", "16384,4096", cap_s=150, contenders="compile,liger"),
    BenchRun("peers at N=65536", "65536", cap_s=150, skip=("erpo", "torch"),
             left_out="torch eager (backend='torch', the readable reference) at N=65536: the slowest contender by "
                      "far (bench/RESULTS.md, N=16384); at four times the rows its check and at least 3 timed runs "
                      "each of fwd and fwd+bwd would take most of the bench stage"),
    BenchRun("the other peers at N=16384 and 4096", "16384,4096", cap_s=DEADLINE_S, skip=("erpo", "compile", "liger")),
    # the logits kernels' variants not in the first run ("log2-1024" is erpo's default): whatever time is left
    BenchRun("the other kernel variants at every N", "4096,16384,65536", cap_s=DEADLINE_S,
             contenders="erpo-warp,erpo-block,erpo-log2"),
)


@dataclass
class Stage:
    """A finished (or stopped) stage: what ran, under which limit, how long, how it ended."""

    name: str
    command: list
    limit_s: float
    seconds: float = 0.0
    exit_code: int | None = None
    status: str = "not run"   # ok | failed | time limit | not run (no time left)
    notes: list = field(default_factory=list)


class GpuCheck:
    """One run of the check: its stages so far, the environment they run in, the files under `out`; temporary
    files (the training run, the bench's own outputs, the wheels' site folder) go to `work`."""

    def __init__(self, out_dir: Path, dry_run: bool, commit: str | None, deadline_s: float = DEADLINE_S):
        self.out = out_dir
        self.deadline_s = deadline_s
        self.dry_run = dry_run
        self.commit = commit
        self.start = time.monotonic()
        self.started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.work = Path(tempfile.mkdtemp(prefix="erpo-gpu-check-"))
        self.stages: list = []
        self.device = "CPU (dry run)" if dry_run else "no nvidia-smi"
        self.wheels = "none"
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH")) if p)
        if dry_run:  # the CPU even on a GPU machine
            self.env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")

    # ---- bookkeeping ------------------------------------------------------------------------------------------

    def log(self, text: str) -> None:
        stamp = f"[{time.monotonic() - self.start:6.1f} s] "
        with open(self.out / "gpu_check.log", "a", encoding="utf-8") as handle:
            handle.write("".join(stamp + line + "\n" for line in text.splitlines() or [""]))
        print(stamp + text, flush=True)

    def time_left(self) -> float:
        return self.deadline_s - SUMMARY_RESERVE_S - (time.monotonic() - self.start)

    def run(self, name: str, command: list, log_file: Path, limit_s: float, mirror: tuple | None = None) -> Stage:
        """Run `command` (output appended to `log_file`) for at most `limit_s` seconds and at most what is left before
        the deadline; `mirror` = (src, dst): copy src to dst every few seconds while it runs and at its end."""
        limit = min(limit_s, self.time_left())
        stage = Stage(name, command, round(limit, 1))
        self.stages.append(stage)
        if limit < MIN_STAGE_S:
            stage.notes.append(f"not started: {max(limit, 0):.0f} s left before the deadline")
            self.log(f"{name}: not started ({max(limit, 0):.0f} s left)")
            return stage
        self.log(f"{name}: limit {limit:.0f} s: {' '.join(command)}")
        begin = time.monotonic()
        with open(log_file, "a", encoding="utf-8") as handle:
            handle.write(f"$ {' '.join(command)}\n")
            handle.flush()
            process = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=handle, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            while process.poll() is None and time.monotonic() - begin < limit:
                time.sleep(1)
                if mirror and int(time.monotonic() - begin) % 5 == 0:
                    _copy(*mirror)
            if process.poll() is None:
                _stop_group(process)
                handle.write(f"\n[gpu_check] stopped at the stage's time limit ({limit:.0f} s)\n")
                stage.status = "time limit"
            else:
                stage.status = "ok" if process.returncode == 0 else "failed"
            stage.exit_code = process.returncode
        if mirror:
            _copy(*mirror)
        stage.seconds = round(time.monotonic() - begin, 1)
        self.log(f"{name}: {stage.status} (exit {stage.exit_code}) after {stage.seconds:.0f} s")
        self.write_summary()
        return stage

    # ---- the stages -------------------------------------------------------------------------------------------

    def setup(self) -> None:
        self.log(f"gpu_check {'dry run ' if self.dry_run else ''}in {REPO}, results in {self.out}, work in {self.work}")
        wheels = sorted(WHEELS.glob("*.whl"))
        if self.dry_run or not wheels:
            self.log("wheels: none installed" + (" (dry run)" if self.dry_run else f" (no {WHEELS}/*.whl)"))
        else:
            site = self.work / "site"
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                   "--no-compile", "--disable-pip-version-check", "--target", str(site),
                                   *map(str, wheels)], capture_output=True, text=True, timeout=120)
            self.wheels = ", ".join(w.name for w in wheels) + ("" if done.returncode == 0 else " (pip failed)")
            self.log(f"wheels: {self.wheels}: pip exit {done.returncode}"
                     + (f"\n{done.stdout}{done.stderr}" if done.returncode else ""))
            self.env["PYTHONPATH"] = os.pathsep.join([str(site), self.env["PYTHONPATH"]])
        versions = []
        for name in ("torch", "triton", "transformers", "pytest", "pytest-timeout"):
            try:
                versions.append(f"{name} {importlib.metadata.version(name)}")
            except importlib.metadata.PackageNotFoundError:
                versions.append(f"{name} missing")
        self.log("python " + sys.version.split()[0] + "; " + ", ".join(versions))
        if shutil.which("nvidia-smi") and not self.dry_run:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            self.device = smi.stdout.strip() or smi.stderr.strip()
        self.log(f"device: {self.device}")

    def kernels(self) -> None:
        python = sys.executable
        if self.dry_run:
            command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DRY_RUN_KERNEL_TESTS]
        else:
            command = [python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--durations=0",
                       "--durations-min=1", KERNEL_TIER]
            if importlib.util.find_spec("pytest_timeout"):
                command[4:4] = ["--timeout", str(KERNEL_TEST_TIMEOUT_S)]
            if importlib.util.find_spec("xdist"):  # a file per worker: module fixtures (the bench smoke run) once
                command[4:4] = ["-n", str(KERNEL_WORKERS), "--dist", "loadfile"]
        self.run("kernels", command, self.out / "kernel-tests.log", KERNEL_LIMIT_S)

    def train(self) -> None:
        run_dir = self.work / "train"
        command = [sys.executable, "-m", "erpo", "train", "--output-dir", str(run_dir), "--max-steps",
                   "1" if self.dry_run else str(TRAIN_STEPS), "--set", "trainer.updater=torch",
                   f"model.cache_dir={self.work / 'model-cache'}"]
        if self.dry_run:  # one tiny step: a few SFT steps, 8 prompts, 2 rollouts of 4 tokens
            command += ["tiny.sft_steps=2", "tiny.sft_examples=16", "tiny.sft_batch_size=8", "data.num_examples=8",
                        "rollout.n=2", "rollout.max_new_tokens=4", "trainer.rollout_batch_size=2",
                        "trainer.update_batch_size=2", "trainer.micro_batch_size=4"]
        self.run("train", command, self.out / "train.log", TRAIN_LIMIT_S,
                 mirror=(run_dir / "metrics.jsonl", self.out / "train-metrics.jsonl"))

    def profile(self) -> None:
        command = [sys.executable, "-m", "bench.kernel_profile", "--path", "fused", "--contenders", "erpo",
                   "--out", str(self.work / "fused-profile")]
        command += ["--smoke"] if self.dry_run else ["--n", "16384"]
        if self.commit:
            command += ["--commit", self.commit]
        self.run("profile", command, self.out / "bench.log", PROFILE_LIMIT_S)

    def bench(self) -> None:
        for index, plan in enumerate(BENCH_RUNS, 1):
            command = [sys.executable, "-m", "bench", *plan.arguments(self.dry_run), "--progress",
                       str(self.out / "bench.jsonl"), "--out", str(self.work / f"bench-{index}")]
            if self.commit:
                command += ["--commit", self.commit]
            stage = self.run(f"bench {index}: {plan.name}", command, self.out / "bench.log", plan.cap_s)
            if plan.left_out:
                stage.notes.append("left out: " + plan.left_out)

    def merge_bench(self) -> None:
        progress = self.out / "bench.jsonl"
        if not progress.exists():
            return
        merged = self.work / "bench-merged"
        done = subprocess.run([sys.executable, "-m", "bench", "--merge", str(progress), "--out", str(merged)],
                              cwd=REPO, env=self.env, capture_output=True, text=True, timeout=SUMMARY_RESERVE_S)
        if done.returncode == 0:
            shutil.copyfile(merged / "results.md", self.out / "bench-results.md")
        self.log(f"bench merge: exit {done.returncode}" + (f"\n{done.stderr[-2000:]}" if done.returncode else ""))

    # ---- the summary ------------------------------------------------------------------------------------------

    def write_summary(self) -> None:
        lines = [f"# GPU check{' (dry run on the CPU: no measurement)' if self.dry_run else ''}", "",
                 f"- device: {self.device}; wheels: {self.wheels}",
                 f"- started: {self.started_at}; {time.monotonic() - self.start:.0f} s so far",
                 f"- commit: {self.commit or 'not given (--commit)'}",
                 f"- command: `bash bench/gpu_check.sh {' '.join(sys.argv[1:])}`", "",
                 "| stage | status | seconds | limit s | exit | command |", "|---|---|---|---|---|---|"]
        for stage in self.stages:
            command = " ".join(stage.command).replace(str(self.work), "$WORK").replace(str(self.out), "$OUT")
            lines.append(f"| {stage.name} | {stage.status} | {stage.seconds:.0f} | {stage.limit_s:.0f} | "
                         f"{stage.exit_code} | `{command}` |")
        lines += [f"- {stage.name}: {note}" for stage in self.stages for note in stage.notes]
        lines += ["", "## Kernel tier", "", *kernel_summary(self.out / "kernel-tests.log"),
                  "", "## Training", "", *train_summary(self.out / "train-metrics.jsonl"),
                  "", "## Fused-path profile", "", *profile_summary(self.work / "fused-profile" / "profile.md"),
                  "", "## Bench", "", *bench_summary(self.out / "bench.jsonl")]
        (self.out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _copy(source: Path, target: Path) -> None:
    if source.exists():
        shutil.copyfile(source, target)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group, SIGKILL 10 s later if it is still there."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def profile_summary(profile: Path) -> list:
    """The profile stage's tables (bench.kernel_profile's profile.md, its title left out)."""
    if not profile.exists():
        return ["(not run)"]
    return profile.read_text(encoding="utf-8").splitlines()[1:]


def kernel_summary(log: Path) -> list:
    """pytest's result line, its failures and its five slowest tests, from the kernel stage's log."""
    if not log.exists():
        return ["(no log)"]
    text = log.read_text(encoding="utf-8", errors="replace").splitlines()
    results = [line.strip("= ") for line in text if re.search(r"\d+ (passed|failed|error)", line)
               and re.search(r" in [\d.]+s", line)]
    failures = [line for line in text if line.startswith(("FAILED ", "ERROR "))]
    slowest = [line for line in text if re.match(r"[\d.]+s (call|setup|teardown) ", line)][:5]
    return ([f"- result: {results[-1] if results else 'no result line (stopped?)'}"]
            + [f"- {line}" for line in failures] + [f"- slow: `{line}`" for line in slowest])


def train_summary(metrics: Path) -> list:
    """The last logged step of the training run."""
    if not metrics.exists():
        return ["(no metrics.jsonl: see train.log)"]
    steps = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not steps:
        return ["(metrics.jsonl is empty)"]
    last = steps[-1]
    keys = ("rollout_step", "reward", "accuracy", "loss", "qkl", "entropy", "grad_norm", "step_seconds")
    return [f"- {len(steps)} steps logged; the last: " + ", ".join(f"{k}={last.get(k)}" for k in keys)]


def bench_summary(progress: Path) -> list:
    """Rows per status, and the rows not reached, from the bench stage's --progress file."""
    if not progress.exists():
        return ["(no bench.jsonl)"]
    from .progress import NOT_REACHED, read_runs

    rows = [row for run in read_runs(progress) for row in run["rows"]]
    counts = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    lines = ["- rows: " + ", ".join(f"{count} {status}" for status, count in counts.items()),
             "- the table: bench-results.md (`python -m bench --merge bench.jsonl --out DIR` rebuilds it)"]
    lines += [f"- {row['status']}: {row['path']} {row['shape']} N={row['N']} {row['contender']}"
              + (f" ({row['detail']})" if row.get("detail") and row["status"] != NOT_REACHED else "")
              for row in rows if row["status"] not in ("ok",)]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bash bench/gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=os.environ.get("OUT"),
                        help="where the 8 result files go (default: $OUT, as on the device machine)")
    parser.add_argument("--dry-run", action="store_true", help="the same stages on the CPU, shrunk (CI)")
    parser.add_argument("--commit", default=None, help="the commit the working tree is (recorded by the bench)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma list of {', '.join(STAGES)} (default: all); e.g. --stages kernels, the kernel "
                             "tier alone (126 s on the 2026-11-25 H200 run), for a lease too short for the rest")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, metavar="SECONDS",
                        help=f"the whole command's time (default {DEADLINE_S}); less leaves room for a second check in "
                             "the same device call")
    args = parser.parse_args(argv)
    if not args.out_dir:
        parser.error("give OUT_DIR (or set $OUT)")
    stages = [name for name in args.stages.split(",") if name]
    if not stages or set(stages) - set(STAGES):
        parser.error(f"--stages: expected a comma list of {', '.join(STAGES)}, got {args.stages!r}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.deadline < SUMMARY_RESERVE_S + MIN_STAGE_S:
        parser.error(f"--deadline: at least {SUMMARY_RESERVE_S + MIN_STAGE_S} s (the summary's reserve and one stage)")
    check = GpuCheck(out, args.dry_run, args.commit, args.deadline)
    check.setup()
    if "kernels" in stages:
        check.kernels()
    if "train" in stages:
        check.train()
    if "profile" in stages:
        check.profile()
    if "bench" in stages:
        check.bench()
        check.merge_bench()
    check.write_summary()
    shutil.rmtree(check.work, ignore_errors=True)
    check.log(f"done in {time.monotonic() - check.start:.0f} s: {out / 'summary.md'}")
    return 0 if all(stage.status == "ok" for stage in check.stages) else 1


if __name__ == "__main__":
    sys.exit(main())
