"""bench/pilot.py: a pilot's runs train with the asked settings, resume after an interruption, stop at --until, and
every kept checkpoint is evaluated on the training distribution and on the held-out set."""
import csv
import json
import shutil

import pytest

from bench import pilot
from erpo.cli.args import config_from_args
from erpo.cli.commands import build_parser
from erpo.eval.problem_sets import load_benchmark

# a minute-sized tiny run (as tests/test_compare.py): small model, 2 prompts x 2 responses, 4 new tokens
SMALL = ["tiny.hidden_size=16", "tiny.intermediate_size=32", "tiny.num_layers=1", "tiny.num_heads=2",
         "tiny.num_kv_heads=1", "tiny.sft_steps=5", "tiny.sft_examples=16", "data.num_examples=8",
         "trainer.rollout_batch_size=2", "trainer.update_batch_size=2", "trainer.micro_batch_size=4", "rollout.n=2",
         "rollout.max_new_tokens=4", "logging.plot=false"]


def test_train_command_resolves_to_the_asked_settings(tmp_path):
    args = pilot.parse_args(["--root", str(tmp_path), "--name", "p", "--lr", "1e-3", "--max-steps", "3000",
                             "--warmup-ratio", "0.01", "--max-operand", "20", "--keep-every", "500"])
    settings = pilot.settings_of(args)
    command = pilot.train_command(settings, "grpo", 3, tmp_path / "grpo-s3", tmp_path / "cache", resume=True)
    assert command[1:4] == ["-m", "erpo", "train"] and command[-1] == "--resume"
    train_args = build_parser().parse_args(command[3:])
    cfg = config_from_args(train_args)
    t = cfg.trainer
    assert (cfg.algorithm.name, t.seed, t.max_steps, t.lr, t.warmup_ratio, t.min_lr_ratio) == (
        "grpo", 3, 3000, 1e-3, 0.01, 1.0)
    assert (t.save_steps, t.keep_every, t.cpu_threads, cfg.data.arithmetic_max_operand) == (100, 500, 1, 20)
    assert cfg.output_dir == str(tmp_path / "grpo-s3") and cfg.model.cache_dir == str(tmp_path / "cache")
    assert "--resume" not in pilot.train_command(settings, "erpo", 3, tmp_path, tmp_path, resume=False)


def test_eval_sets_are_the_training_range_and_beyond_it():
    sets = pilot.eval_sets({"eval_n": 40, "max_operand": 20})
    train, heldout = (load_benchmark(sets[name]) for name in ("train", "heldout"))
    assert (train.name, heldout.name, len(train.problems), len(heldout.problems)) == ("train", "heldout", 40, 40)
    largest = {name: [max(int(x) for x in p["problem"][:-2].replace("-", "+").split("+")) for p in bench.problems]
               for name, bench in (("train", train), ("heldout", heldout))}
    assert max(largest["train"]) <= 20 < min(largest["heldout"])


def test_a_root_inside_the_repository_and_changed_settings_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="inside the repository"):
        pilot.pilot_dir(str(pilot.REPO / "runs"), "x")
    directory = pilot.pilot_dir(str(tmp_path), "x")
    assert directory == tmp_path.resolve() / "pilot-x"
    pilot.check_settings(directory, {"lr": 1e-3, "max_steps": 10})
    pilot.check_settings(directory, {"lr": 1e-3, "max_steps": 10})   # the same: a rerun
    with pytest.raises(SystemExit, match=r"'lr': \(0.001, 0.003\)"):
        pilot.check_settings(directory, {"lr": 3e-3, "max_steps": 10})
    with pytest.raises(SystemExit):
        pilot.parse_args(["--root", str(tmp_path), "--name", "a/b", "--lr", "1", "--max-steps", "1"])
    with pytest.raises(SystemExit):
        pilot.parse_args(["--root", str(tmp_path), "--name", "a", "--lr", "1", "--max-steps", "1",
                          "--save-steps", "3", "--keep-every", "4"])


def _history_steps(path) -> dict[str, set[int]]:
    steps: dict[str, set[int]] = {}
    with open(path, encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            steps.setdefault(row["run"], set()).add(int(row["step"]))
    return steps


def _untimed_steps(metrics: str) -> dict[int, dict]:
    """{step: its last record without timings} (a resumed run appends; readers keep a step's last record)."""
    records = [json.loads(line) for line in metrics.splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.endswith("seconds")} for r in records}


def _journal(directory) -> list[dict]:
    return [json.loads(line) for line in (directory / "journal.jsonl").read_text().splitlines()]


def test_pilot_trains_evaluates_resumes_and_stops(tmp_path, monkeypatch):
    base = ["--root", str(tmp_path), "--name", "t", "--lr", "1e-3", "--max-steps", "2", "--save-steps", "1",
            "--keep-every", "1", "--eval-n", "3", "--k", "2", "--nice", "0"]
    argv = [*base, "--algorithms", "grpo", "--set", *SMALL]
    assert pilot.main(argv) == 0
    directory = tmp_path / "pilot-t"
    run = directory / "grpo-s0"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2 and (run / "final" / "config.json").is_file()
    first = (run / "metrics.jsonl").read_text()
    for set_name in ("train", "heldout"):
        assert _history_steps(directory / f"eval-{set_name}" / "history.csv") == {"grpo-s0": {0, 1, 2}}
        for metric in ("avg@2", "pass@2"):
            table = (directory / f"summary-{set_name}-{metric}" / "long_horizon.md").read_text()
            assert f"### {metric}, temperatures 1.2-1.5" in table and "| 2 |" in table
    journal = _journal(directory)
    assert [(e["event"], e["what"]) for e in journal] == [
        ("start", "train grpo-s0"), ("end", "train grpo-s0"), ("start", "eval train grpo-s0"),
        ("end", "eval train grpo-s0"), ("start", "eval heldout grpo-s0"), ("end", "eval heldout grpo-s0")]
    assert all(e["commit"] and e["machine"] for e in journal) and "--resume" not in journal[0]["command"]

    # interrupted after step 1: the same command resumes from the checkpoint and ends as the first run did (its
    # evaluations, the first leg's again, are left out)
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "checkpoints" / "step-2")
    run_logged = pilot.run_logged
    monkeypatch.setattr(pilot, "run_logged", lambda command, log, journal, what, *rest: 0 if what.startswith("eval ")
                        else run_logged(command, log, journal, what, *rest))
    assert pilot.main(argv) == 0
    resumed = _journal(directory)[len(journal)]
    assert resumed["what"] == "train grpo-s0" and resumed["command"].endswith("--resume")
    assert _untimed_steps((run / "metrics.jsonl").read_text()) == _untimed_steps(first)

    # --until in the past: the first process started is stopped at once and the pilot exits with status 3
    assert pilot.main([*base, "--algorithms", "erpo", "--set", *SMALL, "--until", "00:00"]) == pilot.STOPPED
    assert [e["event"] for e in _journal(directory)[-2:]] == ["start", "stopped"]
    with pytest.raises(SystemExit, match="other settings"):
        pilot.main([*base, "--algorithms", "grpo"])   # the same pilot without its --set overrides


class StandIns:
    """Stand-ins for the pilot's processes: a 'train' writes the run's final/, an 'eval' counts the runs it reads.
    `started`: what each process did (a list of them for processes run side by side); `evaluated`: how many runs
    each evaluation read; `commands`: each training's command by its journal name."""

    def __init__(self, monkeypatch):
        self.started, self.evaluated, self.commands = [], [], {}
        monkeypatch.setattr(pilot, "run_logged", self.run_logged)
        monkeypatch.setattr(pilot, "run_together", self.run_together)
        monkeypatch.setattr(pilot.long_horizon, "main", lambda argv: None)

    def process(self, command, what):
        if what.startswith("train"):
            self.commands[what] = command
            final = pilot.Path(command[command.index("--output-dir") + 1]) / "final"
            final.mkdir(parents=True)
            (final / "config.json").write_text("{}")
        else:
            self.evaluated.append(command[command.index("--model") + 1].count("@all"))

    def run_logged(self, command, log, journal, what, deadline, niceness):
        self.started.append(what)
        self.process(command, what)
        return 0

    def run_together(self, jobs, journal, deadline, niceness):
        self.started.append([job.what for job in jobs])
        for job in jobs:
            self.process(job.command, job.what)

    def clear(self):
        self.started.clear()
        self.evaluated.clear()


def test_seeds_train_one_at_a_time_pair_by_pair_and_a_rerun_does_only_what_is_left(tmp_path, monkeypatch):
    """N seeds of both algorithms: trained one process at a time, seed by seed (an interruption leaves whole pairs),
    every finished run evaluated after each training; a rerun trains only the unfinished run, and a call that finds
    everything finished evaluates once. The processes are stood in for: a 'train' writes the run's final/."""
    stand_ins = StandIns(monkeypatch)
    started, evaluated = stand_ins.started, stand_ins.evaluated
    argv = ["--root", str(tmp_path), "--name", "c", "--lr", "1e-3", "--max-steps", "10", "--seeds", "0", "1", "2"]
    assert pilot.main(argv) == 0
    order = ["grpo-s0", "erpo-s0", "grpo-s1", "erpo-s1", "grpo-s2", "erpo-s2"]
    assert started == [w for name in order for w in (f"train {name}", f"eval train {name}", f"eval heldout {name}")]
    assert evaluated == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]   # the runs finished so far, on both sets

    started.clear()
    evaluated.clear()
    shutil.rmtree(tmp_path / "pilot-c" / "erpo-s1" / "final")   # as if stopped while training erpo-s1
    assert pilot.main(argv) == 0
    assert started == ["train erpo-s1", "eval train erpo-s1", "eval heldout erpo-s1"] and evaluated == [6, 6]
    started.clear()
    evaluated.clear()
    assert pilot.main(argv) == 0
    assert started == ["eval train all", "eval heldout all"] and evaluated == [6, 6]


def test_parallel_trains_a_seeds_runs_side_by_side_then_evaluates_them_and_resumes(tmp_path, monkeypatch):
    """--parallel: each seed's GRPO and ERPO in one run_together call, then one evaluation process at a time over
    every finished run, named after the pair; a run stopped with a checkpoint resumes alone with the same command."""
    stand_ins = StandIns(monkeypatch)
    argv = ["--root", str(tmp_path), "--name", "p", "--lr", "1e-3", "--max-steps", "10", "--seeds", "0", "1",
            "--parallel"]
    assert pilot.main(argv) == 0
    assert stand_ins.started == [
        ["train grpo-s0", "train erpo-s0"], "eval train grpo-s0 erpo-s0", "eval heldout grpo-s0 erpo-s0",
        ["train grpo-s1", "train erpo-s1"], "eval train grpo-s1 erpo-s1", "eval heldout grpo-s1 erpo-s1"]
    assert stand_ins.evaluated == [2, 2, 4, 4]
    assert "--resume" not in stand_ins.commands["train erpo-s1"]

    run = tmp_path / "pilot-p" / "erpo-s1"   # as if stopped at step 5, its checkpoint written
    shutil.rmtree(run / "final")
    (run / "checkpoints" / "step-5").mkdir(parents=True)
    (run / "checkpoints" / "step-5" / "meta.json").write_text("{}")
    stand_ins.clear()
    assert pilot.main(argv) == 0
    assert stand_ins.started == ["train erpo-s1", "eval train erpo-s1", "eval heldout erpo-s1"]
    assert stand_ins.commands["train erpo-s1"][-1] == "--resume" and stand_ins.evaluated == [4, 4]


# a process that marks its start (argv[1]) and ends 0 once its partner's mark (argv[2]) shows, 1 after 30 s without
WAIT_FOR_PARTNER = """import pathlib, sys, time
here, there = map(pathlib.Path, sys.argv[1:])
here.touch()
give_up = time.time() + 30
while not there.exists() and time.time() < give_up:
    time.sleep(0.05)
sys.exit(0 if there.exists() else 1)"""


def test_run_together_runs_side_by_side_waits_for_all_and_stops_all_at_the_deadline(tmp_path):
    """Real processes: two that each wait for the other end 0 (they ran at once); a failing one does not stop the
    other and is named once both end; at the deadline every one still running is stopped (SIGTERM) and journaled."""
    journal = pilot.Journal(tmp_path)
    python = [pilot.sys.executable, "-c"]
    marks = [str(tmp_path / "a.mark"), str(tmp_path / "b.mark")]
    pilot.run_together([pilot.Job([*python, WAIT_FOR_PARTNER, *marks], tmp_path / "a.log", "a"),
                        pilot.Job([*python, WAIT_FOR_PARTNER, *marks[::-1]], tmp_path / "b.log", "b")],
                       journal, None, 0)
    events = [(e["event"], e["what"], e.get("status")) for e in _journal(tmp_path)]
    assert events[:2] == [("start", "a", None), ("start", "b", None)]
    assert sorted(events[2:]) == [("end", "a", 0), ("end", "b", 0)]

    with pytest.raises(SystemExit, match=r"^fails failed with exit status 3; see .*fails.log$"):
        pilot.run_together([pilot.Job([*python, "import sys; sys.exit(3)"], tmp_path / "fails.log", "fails"),
                            pilot.Job([*python, "import time; time.sleep(1)"], tmp_path / "ok.log", "ok")],
                           journal, None, 0)
    assert sorted((e["event"], e["what"], e["status"]) for e in _journal(tmp_path)[4:] if e["event"] == "end") == [
        ("end", "fails", 3), ("end", "ok", 0)]

    past = pilot.datetime.datetime.now(pilot.datetime.timezone.utc) - pilot.datetime.timedelta(seconds=1)
    sleep = [*python, "import time; time.sleep(60)"]
    sleepers = [pilot.Job(sleep, tmp_path / "s.log", "slow"), pilot.Job(sleep, tmp_path / "t.log", "slower")]
    with pytest.raises(pilot.Deadline, match="slow, slower"):
        pilot.run_together(sleepers, journal, past, 0)
    assert [(e["event"], e["what"], e.get("status")) for e in _journal(tmp_path)[-4:]] == [
        ("start", "slow", None), ("start", "slower", None), ("stopped", "slow", -15), ("stopped", "slower", -15)]
