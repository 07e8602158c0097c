"""Pilot runs of the long-horizon tiny experiment (issue 35): GRPO (beta 0.01) and ERPO at one setting of learning
rate, steps and problem difficulty, resumable, every kept checkpoint evaluated at five temperatures on the training
distribution and on the held-out set.

    python -m bench.pilot --root /work/runs --name NAME --lr 1e-3 --max-steps 3000 [--warmup-ratio 0.01]
        [--max-operand 10] [--algorithms grpo erpo] [--seeds 0] [--save-steps 100] [--keep-every 500]
        [--eval-n 128] [--k 16] [--set KEY=VALUE ...] [--nice 19] [--until HH:MM] [--parallel]

Everything goes to ROOT/pilot-NAME/ (ROOT outside the repository):
- `settings.json`: the pilot's settings, written by its first call; a later call with other settings is refused, so
  rerunning the same command continues the same pilot;
- `ALG-sSEED/` and `ALG-sSEED.log`: each training run (`erpo train`, a constant lr after a linear warmup, a
  checkpoint every --save-steps, every --keep-every-th kept for the evaluation) and its log;
- `eval-train/`, `eval-heldout/`: `erpo eval --model ALG-sSEED=RUN@all` of every run's history at temperatures
  0.1, 0.6, 1.0, 1.2, 1.5 with k samples, on `synthetic` problems of the training operand range and on `heldout`
  problems beyond it (history.md, history.csv; one sample cache each, so only new checkpoints are sampled);
- `summary-SET-METRIC/long_horizon.md`: `bench.long_horizon` over the evaluated runs (Avg@k and Pass@k, both sets),
  written at the end;
- `journal.jsonl`: one line per process started or ended (what, UTC time, commit, machine, exit status).

Runs are trained one after the other, seed by seed (GRPO and ERPO of seed 0, then of seed 1, ...: an interruption
leaves complete pairs for the paired comparison), each followed by the evaluation of every finished run (its sample
cache samples only what is new); with --parallel a seed's runs (GRPO and ERPO) train side by side, two processes on
two cores, and are evaluated when both have finished. A finished run is skipped, an unfinished one continues from its
newest checkpoint with `erpo train --resume` (the trainer's exact resume), so the same command after an interruption
goes on where the pilot stopped; a call that finds every run finished evaluates once (what an interrupted evaluation
left). Evaluations run one at a time. Every process runs at --nice (default 19: the lowest priority) with one CPU
thread. With --until HH:MM (UTC, today) the running processes are stopped then (SIGTERM: the trainer writes a
checkpoint) and the pilot exits with status 3.

The comparison of issue 35 is a pilot with several seeds (`--seeds 0 1 2 3 4`) under a name of its own, at the
settings the pilots chose; `bench.long_horizon --paired erpo grpo --late-from STEP` over its evaluation gives the
per-seed differences and the paired tests (docs/pilots.md). Only the repository outlives a session's machine:
`bench.pilot_records` copies what the comparison needs of every finished and evaluated run into it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from bench import long_horizon
from erpo.cli.compare import code_commit, machine_description
from erpo.train.checkpoint import CheckpointManager

REPO = Path(__file__).resolve().parents[1]
TEMPERATURES = "0.1,0.6,1.0,1.2,1.5"
TRAIN_SET_SEED = 7          # the training-distribution problems of the 1000-step experiment (synthetic seed 7)
MAX_NEW_TOKENS = 16         # the tiny default's response budget (rollout.max_new_tokens)
STOPPED = 3                 # exit status when --until stopped the pilot
POLL_SECONDS = 1.0          # how often processes run side by side are checked for their end


class Deadline(Exception):
    """--until passed while a process ran; it was stopped."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.pilot", description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="folder outside the repository; the pilot goes to ROOT/pilot-NAME")
    p.add_argument("--name", required=True, help="the pilot's name (letters, digits, . _ -)")
    p.add_argument("--lr", type=float, required=True, help="trainer.lr, constant after the warmup")
    p.add_argument("--max-steps", type=int, required=True, help="rollout steps of every run")
    p.add_argument("--warmup-ratio", type=float, default=0.0,
                   help="trainer.warmup_ratio (0: none; a run with a warmup cannot be extended past --max-steps)")
    p.add_argument("--max-operand", type=int, default=10,
                   help="data.arithmetic_max_operand: training (and SFT) operands; held-out ones lie above it")
    p.add_argument("--algorithms", nargs="+", default=["grpo", "erpo"], choices=["grpo", "erpo"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--save-steps", type=int, default=100, help="checkpoint every N rollout steps (what resumes)")
    p.add_argument("--keep-every", type=int, default=500, help="keep every N-th step's checkpoint (evaluated)")
    p.add_argument("--eval-n", type=int, default=128, help="problems per evaluation set")
    p.add_argument("--k", type=int, default=16, help="samples per problem and temperature")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="further `erpo train --set` overrides of every run (part of the settings)")
    p.add_argument("--nice", type=int, default=19, help="niceness of every process started (never lowered)")
    p.add_argument("--until", help="HH:MM UTC today: stop the running processes then (they checkpoint) and exit")
    p.add_argument("--parallel", action="store_true",
                   help="train a seed's algorithms side by side (one process each), then evaluate them")
    args = p.parse_args(argv)
    if not args.name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        p.error(f"--name {args.name!r}: use letters, digits, '.', '_' and '-' only")
    if args.keep_every % args.save_steps:
        p.error(f"--keep-every {args.keep_every} must be a multiple of --save-steps {args.save_steps}")
    return args


def settings_of(args: argparse.Namespace) -> dict:
    """What defines the pilot's runs and evaluation (settings.json)."""
    keys = ("lr", "max_steps", "warmup_ratio", "max_operand", "save_steps", "keep_every", "eval_n", "k", "overrides")
    # --root, --algorithms, --seeds, --nice, --until and --parallel may differ between calls
    return {key: getattr(args, key) for key in keys}


def pilot_dir(root: str, name: str) -> Path:
    """ROOT/pilot-NAME, refused inside the repository (run outputs never enter it)."""
    path = Path(root).resolve() / f"pilot-{name}"
    if path == REPO or REPO in path.parents:
        raise SystemExit(f"--root {root}: inside the repository {REPO}; put pilot runs outside it (e.g. /work/runs)")
    return path


def settings_difference(first: dict, second: dict) -> dict:
    """{key: (first's value, second's)} of every setting the two differ in (None: absent); {} when equal."""
    return {k: (first.get(k), second.get(k)) for k in sorted(first.keys() | second.keys())
            if first.get(k) != second.get(k)}


def check_settings(directory: Path, settings: dict) -> None:
    """Write settings.json on the first call; refuse a later call whose settings differ."""
    path = directory / "settings.json"
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved != settings:
            changed = settings_difference(saved, settings)
            raise SystemExit(f"{path}: this pilot was started with other settings ({changed}, as (saved, asked)); "
                             "rerun it with the saved ones or name a new pilot")
        return
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")


def train_command(settings: dict, algorithm: str, seed: int, run_dir: Path, cache_dir: Path,
                  resume: bool) -> list[str]:
    """`erpo train` of one pilot run (with --resume when it has a checkpoint)."""
    command = [
        sys.executable, "-m", "erpo", "train", "--algorithm", algorithm, "--seed", str(seed),
        "--max-steps", str(settings["max_steps"]), "--output-dir", str(run_dir),
        "--save-steps", str(settings["save_steps"]), "--set", f"trainer.lr={settings['lr']:g}",
        f"trainer.warmup_ratio={settings['warmup_ratio']:g}", "trainer.min_lr_ratio=1",
        f"trainer.keep_every={settings['keep_every']}", "trainer.cpu_threads=1",
        f"data.arithmetic_max_operand={settings['max_operand']}", f"model.cache_dir={cache_dir}",
        "logging.progress_bar=false", "logging.tensorboard=false", *settings["overrides"]]
    return command + (["--resume"] if resume else [])


def eval_sets(settings: dict) -> dict[str, str]:
    """{set name: benchmark spec}: the training distribution and the held-out problems beyond it."""
    n, bound = settings["eval_n"], settings["max_operand"]
    return {"train": f"train=synthetic#n={n}#seed={TRAIN_SET_SEED}#max_operand={bound}",
            "heldout": f"heldout=heldout#n={n}#larger_than={bound}"}


def eval_command(settings: dict, runs: dict[str, Path], spec: str, out_dir: Path) -> list[str]:
    """`erpo eval` of every run's history (start and kept checkpoints) on one benchmark at the five temperatures."""
    return [sys.executable, "-m", "erpo", "eval", "--model", ",".join(f"{n}={d}@all" for n, d in runs.items()),
            "--benchmarks", spec, "--temperatures", TEMPERATURES, "--k", str(settings["k"]),
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--output-dir", str(out_dir), "--no-progress"]


def planned_runs(directory: Path, algorithms: list[str], seeds: list[int]) -> dict[str, Path]:
    """{ALG-sSEED: its folder} in training order: seed by seed, each seed's algorithms in the order given."""
    return {f"{a}-s{s}": directory / f"{a}-s{s}" for s in seeds for a in algorithms}


def training_batches(runs: dict[str, Path], parallel: bool) -> list[dict[str, Path]]:
    """The runs trained at once, in order: each run alone, or with `parallel` each seed's runs (ALG-sSEED with the
    same SEED) together."""
    if not parallel:
        return [{name: run_dir} for name, run_dir in runs.items()]
    by_seed: dict[str, dict[str, Path]] = {}
    for name, run_dir in runs.items():
        by_seed.setdefault(name.rsplit("-s", 1)[1], {})[name] = run_dir
    return list(by_seed.values())


def run_state(run_dir: Path) -> str:
    """'finished' (final/ written), 'resume' (a checkpoint to continue from) or 'fresh'."""
    if (run_dir / "final" / "config.json").is_file():
        return "finished"
    return "resume" if CheckpointManager(run_dir, keep_last=None).latest() is not None else "fresh"


def deadline_of(until: str | None) -> datetime.datetime | None:
    if until is None:
        return None
    hour, minute = (int(x) for x in until.split(":"))
    return datetime.datetime.now(datetime.timezone.utc).replace(hour=hour, minute=minute, second=0, microsecond=0)


class Journal:
    """journal.jsonl: one line per process started or ended."""

    def __init__(self, directory: Path):
        self.path = directory / "journal.jsonl"
        self.context = {"commit": code_commit(), "machine": machine_description()}

    def write(self, **entry) -> None:
        entry = {"utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **entry}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({**entry, **self.context}) + "\n")


class Job(NamedTuple):
    """One process to run: its command, the log it appends to and what the journal calls it."""
    command: list[str]
    log: Path
    what: str


def run_together(jobs: list[Job], journal: Journal, deadline: datetime.datetime | None, niceness: int) -> None:
    """Run the jobs' commands side by side (each at `niceness`, one thread, this checkout first on the path), each
    appending to its log, and wait for all of them. At `deadline` (raises Deadline) or when this process is
    terminated, every one still running is stopped with SIGTERM (the trainer checkpoints). A job that fails does not
    stop the others: SystemExit naming each failed one once all have ended."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    running: dict[str, tuple[Job, subprocess.Popen]] = {}   # by what the journal calls them
    failed = []
    try:
        for job in jobs:
            journal.write(event="start", what=job.what, command=" ".join(job.command))
            with open(job.log, "a", encoding="utf-8") as handle:
                running[job.what] = job, subprocess.Popen(
                    job.command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                    preexec_fn=lambda: os.nice(max(0, niceness - os.nice(0))))
        while True:
            for job, process in list(running.values()):
                if (status := process.poll()) is not None:
                    del running[job.what]
                    journal.write(event="end", what=job.what, status=status)
                    if status != 0:
                        failed.append(f"{job.what} failed with exit status {status}; see {job.log}")
            if not running:
                break
            left = POLL_SECONDS if deadline is None else min(
                POLL_SECONDS, (deadline - datetime.datetime.now(datetime.timezone.utc)).total_seconds())
            if left <= 0:
                raise Deadline(", ".join(running))
            _, first = next(iter(running.values()))
            try:   # wakes as soon as the first one ends; the others are checked every POLL_SECONDS
                first.wait(timeout=left)
            except subprocess.TimeoutExpired:
                pass
    except BaseException:  # the deadline, or this process terminated / interrupted
        for _, process in running.values():
            process.send_signal(signal.SIGTERM)
        for what, (_, process) in running.items():
            journal.write(event="stopped", what=what, status=process.wait())
        raise
    if failed:
        raise SystemExit("; ".join(failed))


def run_logged(command: list[str], log: Path, journal: Journal, what: str,
               deadline: datetime.datetime | None, niceness: int) -> int:
    """Run one `command` as `run_together` runs several. Returns its exit status (0: any other raises)."""
    run_together([Job(command, log, what)], journal, deadline, niceness)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    directory = pilot_dir(args.root, args.name)
    settings = settings_of(args)
    check_settings(directory, settings)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    journal, deadline = Journal(directory), deadline_of(args.until)
    runs = planned_runs(directory, args.algorithms, args.seeds)

    def evaluate(after: str) -> None:   # every finished run's history, on both sets
        evaluated = {n: d for n, d in runs.items() if run_state(d) == "finished"}
        for set_name, spec in eval_sets(settings).items():
            run_logged(eval_command(settings, evaluated, spec, directory / f"eval-{set_name}"),
                       directory / f"eval-{set_name}.log", journal, f"eval {set_name} {after}", deadline, args.nice)

    def train_job(name: str, run_dir: Path) -> Job:
        algorithm, seed = name.rsplit("-s", 1)
        command = train_command(settings, algorithm, int(seed), run_dir, directory.parent / "cache",
                                resume=run_state(run_dir) == "resume")
        return Job(command, directory / f"{name}.log", f"train {name}")

    try:
        trained = False
        for batch in training_batches(runs, args.parallel):
            todo = {name: train_job(name, run_dir) for name, run_dir in batch.items()
                    if run_state(run_dir) != "finished"}
            if not todo:
                continue
            if len(todo) == 1:
                (job,) = todo.values()
                run_logged(job.command, job.log, journal, job.what, deadline, args.nice)
            else:
                run_together(list(todo.values()), journal, deadline, args.nice)
            trained = True
            evaluate(after=" ".join(todo))
        if not trained:   # the last call may have stopped during an evaluation
            evaluate(after="all")
        for set_name in eval_sets(settings):
            for metric in (f"avg@{args.k}", f"pass@{args.k}"):
                long_horizon.main(["--runs", str(directory), "--history",
                                   str(directory / f"eval-{set_name}" / "history.csv"), "--metric", metric,
                                   "--out", str(directory / f"summary-{set_name}-{metric}")])
    except Deadline as stopped:
        print(f"--until {args.until}: stopped {stopped}; rerun the same command to continue", file=sys.stderr)
        return STOPPED
    return 0


if __name__ == "__main__":
    sys.exit(main())
