"""End-to-end fault tolerance of `erpo train` on CPU (tiny model, plain torch backend):

- exact resume: `--max-steps 2` then `--resume --max-steps 4` logs the same metrics (to 1e-5) and exports
  the same final model as one uninterrupted `--max-steps 4` run;
- SIGTERM: the run finishes its current step, saves a checkpoint, exits 0, and resuming from it again
  reproduces the uninterrupted run (the signal comes while a reward function, tests/workers/held_reward.py, holds
  the run in rollout step 2: it cannot finish first, however fast the machine).

The LR schedule is constant (trainer.min_lr_ratio=1) because a cosine schedule's length depends on
--max-steps, which legitimately differs between the two halves of the interrupted run; with a cosine schedule
such a resume is refused. Every checkpoint holds a Hugging Face export of its model (`step-N/hf/`).

The resume after two steps, and the runs stopped by a signal, are processes of their own (`erpo_train`), as a user
starts them; the runs that only give them what to match or what to resume from, and the resume of the SIGTERMed run
(what it checks is the checkpoint the signal left), run `erpo train` in this process (`erpo_train_here`: the same
command line, without a child's 5 s of imports).
"""
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import run_metrics
from erpo.cli.commands import main
from erpo.distributed import LAUNCHER_VARIABLES
from paths import WORKERS
from run_metrics import metrics_by_step
from test_checkpoint import wait_for_path

REPO = Path(__file__).resolve().parents[2]


def small_run_args(cache_dir: Path) -> list[str]:
    return ["--seed", "3", "--save-steps", "1", "--set", "tiny.sft_steps=5", "tiny.sft_examples=64",
            f"model.cache_dir={cache_dir}", "data.num_examples=32", "trainer.rollout_batch_size=4",
            "trainer.update_batch_size=2", "trainer.micro_batch_size=4", "trainer.min_lr_ratio=1.0",
            "trainer.keep_last=2", "rollout.n=2", "rollout.max_new_tokens=8", "logging.tensorboard=false",
            "logging.progress_bar=false", "logging.plot=false",
            # the 5-step warm start earns no reward: the entropy bonus gives the updates a gradient (at theta0 the
            # Query-KL's is exactly 0, now that the reference cache sums ell_theta0(q) as the loss sums ell_theta(q))
            "algorithm.entropy_coef=0.01"]


# the launcher's variables (erpo.distributed.LAUNCHER_VARIABLES) an in-process run earlier in this pytest worker may
# have left set (in the parallel suite of 2026-11-28 a child `erpo train` inherited MASTER_PORT=29500, bound by then:
# EADDRINUSE): a child `erpo train` is one process started from a shell, which picks a free port of its own
# (erpo.distributed.set_launcher_env)
def env():
    """The environment of an `erpo train` started as a user starts it: this checkout first on PYTHONPATH, one thread,
    no GPU, no launcher's variables."""
    kept = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    return dict(kept, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def erpo_train(out: Path, cache_dir: Path, *extra: str, sets: tuple[str, ...] = (),
               succeed: bool = True) -> subprocess.CompletedProcess:
    """`erpo train` with the small settings; `sets`: more --set overrides, applied after them."""
    cmd = [sys.executable, "-m", "erpo", "train", "--output-dir", str(out), *extra, *small_run_args(cache_dir),
           *sets]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300, check=False)
    assert (proc.returncode == 0) == succeed, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def erpo_train_here(out: Path, cache_dir: Path, *extra: str, sets: tuple[str, ...] = ()) -> None:
    """`erpo train` with the small settings, as `erpo_train` runs it but in this process (`erpo.cli`'s main, the
    same command line): for the runs whose subject is what a run saves and resumes, not the process around it,
    which `erpo_train`'s runs below keep covering; it must succeed."""
    assert main(["train", "--output-dir", str(out), *extra, *small_run_args(cache_dir), *sets]) == 0


# `erpo train`'s runs in child processes, each compared with the uninterrupted one to this absolute tolerance
assert_same_metrics = functools.partial(run_metrics.assert_same_metrics, abs_tol=1e-5)


# a second reward function that rewards nothing (the runs log what they log without it) and, in the process whose
# environment names a folder, holds its rollout step until the test says (tests/workers/held_reward.py)
HELD_REWARD = (f"reward.functions=[math,{WORKERS / 'held_reward.py'}:hold]",)


def start_held_run(out: Path, cache_dir: Path, hold: Path, *extra: str, step: int) -> subprocess.Popen:
    """`erpo train` with the small settings and HELD_REWARD in a child process (stderr a pipe), returned once its
    reward function holds it inside rollout step `step` (`hold`/held exists): it stays there, alive and holding the
    run's lock, until the test creates `hold`/release or kills it, however fast the machine. Fails with the end of
    its stderr if the run ends first, and kills it if it is not held within 240 s."""
    hold.mkdir()
    cmd = [sys.executable, "-m", "erpo", "train", "--output-dir", str(out), *extra, *small_run_args(cache_dir),
           *HELD_REWARD]
    proc = subprocess.Popen(cmd, env=dict(env(), ERPO_TEST_HOLD_DIR=str(hold), ERPO_TEST_HOLD_STEP=str(step)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_path(proc, hold / "held", f"rollout step {step}'s rewards", timeout=240)
    except BaseException:
        proc.kill()
        proc.stderr.close()
        raise
    return proc


def assert_same_model(a: Path, b: Path):
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(wa) == sorted(wb)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    erpo_train_here(root / "full", root / "cache", "--max-steps", "4")
    records = metrics_by_step(root / "full")
    assert len(records) == 8 and max(r["rollout_step"] for r in records.values()) == 4  # 2 updates per rollout
    assert len({round(r["loss"], 12) for r in records.values()}) > 1                      # it is really training
    return root


def test_stop_after_two_steps_then_resume_matches(uninterrupted):
    root = uninterrupted
    run = root / "halves"
    erpo_train_here(run, root / "cache", "--max-steps", "2")
    first_half = metrics_by_step(run)
    assert max(first_half) == 4 and (run / "checkpoints" / "step-2").is_dir()
    erpo_train(run, root / "cache", "--max-steps", "4", "--resume")   # a new process: all from the checkpoint
    assert_same_metrics(metrics_by_step(run), metrics_by_step(root / "full"))
    assert_same_model(run / "final", root / "full" / "final")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-3", "step-4"]   # keep_last=2
    assert_same_model(run / "checkpoints" / "step-4" / "hf", run / "final")
    assert (run / "checkpoints" / "step-3" / "hf" / "config.json").is_file()


def checkpoint_state(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step-{step}" / "meta.json").read_text())["state"]


def test_resume_refuses_another_cosine_schedule_length(uninterrupted, capsys):
    root = uninterrupted
    run = root / "cosine"
    cosine = ("trainer.min_lr_ratio=0.1",)
    erpo_train_here(run, root / "cache", "--max-steps", "1", sets=cosine)
    assert checkpoint_state(run, 1)["lr_schedule_steps"] == 2                 # 1 rollout step x 2 updates
    capsys.readouterr()
    assert main(["train", "--output-dir", str(run), "--max-steps", "2", "--resume", *small_run_args(root / "cache"),
                 *cosine]) == 1                                                # one line (an error would raise here)
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("erpo train:")]
    assert line.startswith(f"erpo train: --resume {run}: the checkpoint's LR schedule (warmup + cosine) spans 2 "
                           "optimizer steps, but this config's spans 4 (trainer.max_steps=2")
    assert "resume with --max-steps 1" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]
    # a checkpoint written before the length was recorded (and before manifests) resumes unchecked, and records it
    # from then on
    meta_file = run / "checkpoints" / "step-1" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["state"]["lr_schedule_steps"], meta["files"], meta["meta_sha256"]
    meta_file.write_text(json.dumps(meta))
    erpo_train_here(run, root / "cache", "--max-steps", "2", "--resume", sets=cosine)
    assert checkpoint_state(run, 2)["lr_schedule_steps"] == 4


def test_resume_refuses_another_training_set(uninterrupted, capsys, caplog):
    """A resume with other training prompts (fewer; as many, but others) is refused in one line naming the counts
    before and after, before the reference cache is looked at (whose own advice, rebuild it, would lose the run's
    cache): the checkpoint's data order and position would apply to other prompts. A checkpoint saved before the
    training set was recorded resumes with a warning, and the run records it from then on."""
    root = uninterrupted
    run = root / "data"
    erpo_train_here(run, root / "cache", "--max-steps", "1")
    recorded = checkpoint_state(run, 1)["training_set"]
    assert recorded["prompts"] == 32
    for other_data, then_now in (("data.num_examples=31", "32 prompts then, 31 now"),
                                 ("data.use_chat_template=false", "32 prompts then and now, other prompt token ids")):
        capsys.readouterr()
        assert main(["train", "--output-dir", str(run), "--max-steps", "2", "--resume",
                     *small_run_args(root / "cache"), other_data]) == 1
        [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("erpo train:")]
        assert line.startswith(f"erpo train: --resume {run}: the checkpoint trained on another training set "
                               f"({then_now})"), line
        assert "resume with the data it started with" in line and "start a new run" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]
    meta_file = run / "checkpoints" / "step-1" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["state"]["training_set"], meta["files"], meta["meta_sha256"]
    meta_file.write_text(json.dumps(meta))
    erpo_train_here(run, root / "cache", "--max-steps", "2", "--resume")
    [warning] = [r.getMessage() for r in caplog.records if "records no training set" in r.getMessage()]
    assert warning.startswith(f"--resume {run}: checkpoint step-1 records no training set")
    assert checkpoint_state(run, 2)["training_set"] == recorded


def test_sigterm_saves_and_resume_matches(uninterrupted):
    """A real SIGTERM to a real `erpo train` inside rollout step 2 of 4: the run is held in that step's reward until
    the signal has been sent (so no machine is fast enough to finish first); the step finishes, is saved and logged,
    the run exits 0, and `--resume` (in this process: what it reads is the checkpoint the signal left;
    test_stop_after_two_steps_then_resume_matches resumes in a new process) logs and exports what the uninterrupted
    run did."""
    root = uninterrupted
    run, hold = root / "sigterm", root / "sigterm-hold"
    proc = start_held_run(run, root / "cache", hold, "--max-steps", "4", step=2)
    try:
        proc.send_signal(signal.SIGTERM)
        (hold / "release").touch()
        _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    assert "received SIGTERM" in stderr and "stopped by signal after rollout step 2;" in stderr, stderr[-4000:]
    assert "INFO erpo: done: " not in stderr, stderr[-4000:]   # stopped, not done
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert not (run / "final").exists()
    assert max(r["rollout_step"] for r in metrics_by_step(run).values()) == 2   # the signalled step was finished
    erpo_train_here(run, root / "cache", "--max-steps", "4", "--resume", sets=HELD_REWARD)   # nothing held: no folder
    assert_same_metrics(metrics_by_step(run), metrics_by_step(root / "full"))
    assert_same_model(run / "final", root / "full" / "final")
