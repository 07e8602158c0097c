"""Ctrl-C and kills of `erpo train`, run as a user runs it (a terminal of its own; Ctrl-C typed there reaches the
whole process group, the math-verify child included):

- one Ctrl-C: the current rollout step finishes, a checkpoint of it is saved, one line says so, no traceback from any
  process, exit status 130; `--resume` continues and metrics.jsonl holds every step once;
- Ctrl-C twice, or SIGTERM twice: stops at once (the step it was in neither finished nor saved), in one line, exit
  status 130 (143 for SIGTERM);
- Ctrl-C or SIGTERM during the SFT warm start: stops at once in one line naming it, caching nothing (exit 130 / 143);
- a run killed after it logged a step's metrics but before the next checkpoint: `--resume` drops those records and
  logs them again, so no step is in metrics.jsonl twice (it held step 3 twice before).
"""
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from erpo.cli.commands import main
from terminal import TerminalRun
from test_resume import HELD_REWARD, env, small_run_args

STEPS = 500   # more than any test waits for: a run stopped here was stopped, not finished


def train_command(out: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "erpo", "train", "--output-dir", str(out), *extra, *small_run_args(cache),
            "logging.progress_bar=true"]


def logged_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def logged_rollout_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["rollout_step"] for line in lines if line.endswith("}")]


def checkpoint_steps(out: Path) -> list[int]:
    root = out / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*")) if root.is_dir() else []


def resume_and_check(out: Path, cache: Path, max_steps: int, *sets: str) -> None:
    """`--resume` to `max_steps` (in this process: what is checked is what the stopped run left, not how the new one
    starts; tests/train/test_resume.py's resumes are processes of their own; `sets`: the stopped run's own --set
    items after the small settings): exit 0, and metrics.jsonl holds optimizer steps 1, 2, ... each once."""
    assert main(train_command(out, cache, "--max-steps", str(max_steps), "--resume")[3:] + list(sets)) == 0
    steps = logged_steps(out)
    assert steps == list(range(1, len(steps) + 1)), steps
    assert logged_rollout_steps(out)[-1] == max_steps


def stop_with_ctrl_c(run: TerminalRun, *moments: tuple[Callable[[], bool], float, str], timeout: float) -> None:
    """Type Ctrl-C at each of `moments` in turn (when its condition holds: `TerminalRun.wait_for`'s condition,
    timeout in s and what), then assert that `run` exits with status 130 within `timeout` s and that no process
    printed a traceback; the run is killed whatever happens."""
    try:
        for condition, wait, what in moments:
            run.wait_for(condition, timeout=wait, what=what)
            run.ctrl_c()
        status = run.wait(timeout=timeout)
    finally:
        run.kill()
    assert status == 130, run.output[-4000:]
    assert "Traceback" not in run.output and "KeyboardInterrupt" not in run.output, run.output[-6000:]


def test_ctrl_c_finishes_the_step_saves_and_exits_130_in_one_line(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    run = TerminalRun(train_command(out, cache, "--max-steps", str(STEPS), "--save-steps", "1"), env=env())
    stop_with_ctrl_c(run, (lambda: checkpoint_steps(out), 240, "first checkpoint"), timeout=240)
    received = [line for line in run.output.splitlines() if "received SIGINT" in line]
    stopped = [line for line in run.output.splitlines() if "stopped by signal after rollout step" in line]
    assert len(received) == 1 and len(stopped) == 1, run.output[-4000:]
    stopped_at = int(stopped[0].split("rollout step ")[1].split(";")[0])
    assert checkpoint_steps(out)[-1] == stopped_at < STEPS             # the step it was in, finished and saved
    assert logged_rollout_steps(out)[-1] == stopped_at                  # and logged: nothing past the checkpoint
    assert not (out / "final").exists() and not (out / "run.lock").exists()
    resume_and_check(out, cache, stopped_at + 2)


@pytest.mark.parametrize("stop, status, how", [("Ctrl-C", 130, "interrupted (Ctrl-C)"),
                                               ("SIGTERM", 143, "stopped (SIGTERM)")])
def test_a_second_ctrl_c_or_sigterm_stops_at_once_in_one_line(tmp_path, stop, status, how):
    # Both signals come while a reward function holds the run inside rollout step 2 (tests/workers/held_reward.py),
    # each sent once the run shows what it answers (the step reached, the first one's line): the second lands inside
    # the step however loaded the machine (typed at the first checkpoint's appearance, a second Ctrl-C could come
    # after the step had finished and been saved, while the run was exiting)
    out, cache, hold = tmp_path / "run", tmp_path / "cache", tmp_path / "hold"
    hold.mkdir()
    run = TerminalRun(train_command(out, cache, "--max-steps", str(STEPS)) + list(HELD_REWARD),
                      env=dict(env(), ERPO_TEST_HOLD_DIR=str(hold), ERPO_TEST_HOLD_STEP="2"))
    send = run.ctrl_c if stop == "Ctrl-C" else lambda: os.killpg(run.proc.pid, signal.SIGTERM)
    try:
        for condition, what in ((lambda: (hold / "held").exists(), "rollout step 2's rewards"),
                                (lambda: f"received {'SIGINT' if stop == 'Ctrl-C' else 'SIGTERM'}" in run.output,
                                 "the first signal's line")):
            run.wait_for(condition, timeout=240, what=what)
            send()
        exit_status = run.wait(timeout=240)
    finally:
        run.kill()
    assert exit_status == status and "Traceback" not in run.output, run.output[-4000:]
    ends = [line for line in run.output.splitlines()
            if f"erpo train: {how}; the checkpoints saved so far are kept" in line
            or "stopped by signal after rollout step" in line]
    assert len(ends) == 1 and how in ends[0], run.output[-3000:]
    assert checkpoint_steps(out) == [1] and not (out / "run.lock").exists()   # step 2 neither finished nor saved
    resume_and_check(out, cache, 3, *HELD_REWARD)   # the same reward functions; nothing held: no folder


def test_a_run_killed_between_a_metrics_write_and_the_next_checkpoint_resumes_without_a_repeated_step(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    proc = subprocess.Popen(train_command(out, cache, "--max-steps", str(STEPS), "--save-steps", "3"), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # Freeze the run (SIGSTOP) once metrics.jsonl logs a rollout step past the newest checkpoint; if that
        # checkpoint was written meanwhile, let it go on and try again.
        while True:
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            saved = checkpoint_steps(out)
            if saved and max(logged_rollout_steps(out), default=0) > saved[-1]:
                os.killpg(proc.pid, signal.SIGSTOP)
                if max(logged_rollout_steps(out)) > checkpoint_steps(out)[-1]:
                    break
                os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stderr.close()
    saved = checkpoint_steps(out)[-1]
    assert max(logged_rollout_steps(out)) > saved   # records past the checkpoint, which the resumed run logs again

    resume_and_check(out, cache, saved + 3)


def test_the_math_verify_child_leaves_ctrl_c_to_its_parent(tmp_path):
    # Ctrl-C reaches the whole process group: the child of the math reward says nothing and keeps answering until
    # its parent ends it (it printed a traceback of its own before)
    run = TerminalRun([sys.executable, "-m", "erpo.tasks.answer_worker"], env=env())
    try:
        run.wait_for(lambda: '{"ready"' in run.output, timeout=120, what="math-verify's ready line")
        run.ctrl_c()
        os.write(run.master, b'["\\\\frac{1}{2}", "0.5"]\n')
        run.wait_for(lambda: run.output.rstrip().endswith("true"), timeout=60, what="an answer after Ctrl-C")
        os.write(run.master, b"\x04")   # Ctrl-D: end of input, as the parent's closing its pipe
        status = run.wait(timeout=60)
    finally:
        run.kill()
    assert status == 0 and "Traceback" not in run.output, run.output


@pytest.mark.parametrize("stop, status, how", [("Ctrl-C", 130, "interrupted (Ctrl-C)"),
                                               ("SIGTERM", 143, "stopped (SIGTERM)")])
def test_a_stop_during_the_sft_warm_start_ends_in_one_line_and_caches_nothing_partial(tmp_path, stop, status, how):
    # Ctrl-C at the terminal, or SIGTERM to the process group (`timeout`, a batch scheduler): before the first rollout
    # step there is no step to finish, so either stops at once (SIGTERM ended the process silently before)
    out, cache = tmp_path / "run", tmp_path / "cache"
    run = TerminalRun(train_command(out, cache, "--max-steps", "2") + ["tiny.sft_steps=100000"], env=env())
    try:
        run.wait_for(lambda: "tiny theta0 SFT:" in run.output, timeout=240, what="the warm start's progress bar")
        run.ctrl_c() if stop == "Ctrl-C" else os.killpg(run.proc.pid, signal.SIGTERM)
        exit_status = run.wait(timeout=120)
    finally:
        run.kill()
    assert exit_status == status and "Traceback" not in run.output, run.output[-4000:]
    last = run.output.rstrip().splitlines()[-1]   # after the bar (and the terminal's echo of Ctrl-C)
    assert last.endswith(f"erpo train: {how} during the tiny model's SFT warm start; nothing was cached (the same "
                         "command runs it again)"), run.output[-2000:]
    assert not cache.exists() or not list(cache.iterdir())   # no theta0, not even a temporary copy
    assert not (out / "run.lock").exists()
