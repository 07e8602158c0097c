"""Storage faults end to end, `erpo train` on CPU (tiny model, one process; the 2-rank case is in
tests/distributed/test_multirank.py):

- a save refused by the storage (ENOSPC injected into torch.save, as a full disk raises it): one line naming the
  path and the cause, exit 1, no half-written checkpoint; `--resume` from the previous checkpoint then logs what an
  uninterrupted run logs;
- the newest checkpoint damaged (an optimizer file truncated): one warning line naming it and the file, the run
  resumes from the one before and again logs what an uninterrupted run logs; every checkpoint damaged (bit flips,
  found by the digests): one error line, exit 1;
- a second `erpo train --resume` while the first run lives (held inside rollout step 2 by a reward function,
  tests/workers/held_reward.py, so it cannot end first): refused in one line naming it; after the first is
  SIGKILLed: allowed (the lock is taken over with a warning), and the run again matches the uninterrupted one.
"""
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from damage import flip_bit, truncate
from erpo.cli.commands import main
from run_metrics import metrics_by_step
from test_resume import (
    HELD_REWARD,
    assert_same_metrics,
    env,
    erpo_train_here,
    small_run_args,
    start_held_run,
)

ENOSPC_AT_STEP_3 = r"""
import errno, os, sys
import torch
real_save = torch.save

def full_disk_save(obj, f, *args, **kwargs):
    if ".tmp-step-3" in str(f):     # the disk fills up while checkpoint step-3 is written
        with open(f, "wb") as handle:
            handle.write(b"PK\x03\x04 partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    return real_save(obj, f, *args, **kwargs)

torch.save = full_disk_save
from erpo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("erpo train:")]


def refused_here(run: Path, cache: Path, capsys, sets: tuple[str, ...] = ()) -> list[str]:
    """`erpo train --resume` of `run` in this process (test_resume.erpo_train_here's command line, `sets` after it),
    which must exit 1 (an error that is not the user's would raise here, where a child process prints its
    traceback): the lines it printed that start with "erpo train:"."""
    capsys.readouterr()
    assert main(["train", "--output-dir", str(run), "--max-steps", "3", "--resume", *small_run_args(cache),
                 *sets]) == 1
    return error_lines(capsys.readouterr().err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 3-step run (`full`), and a 3-step run whose last save hit a full disk (`pristine`: a copy of
    its run directory as that left it, and its stderr)."""
    root = tmp_path_factory.mktemp("storage")
    erpo_train_here(root / "full", root / "cache", "--max-steps", "3")   # what the resumed runs must log
    script = root / "enospc.py"
    script.write_text(ENOSPC_AT_STEP_3)
    cmd = [sys.executable, str(script), "train", "--output-dir", str(root / "enospc"), "--max-steps", "3",
           *small_run_args(root / "cache")]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300, check=False)
    shutil.copytree(root / "enospc", root / "pristine")
    return root, proc


def test_a_full_disk_stops_the_run_in_one_line_and_the_previous_checkpoint_resumes_exactly(runs):
    root, proc = runs
    run = root / "enospc"
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    assert error_lines(proc.stderr) == [
        (f"erpo train: saving checkpoint step-3 failed: {run / 'checkpoints' / '.tmp-step-3' / 'rng' / 'rank-0.pt'}: "
         "No space left on device; the previous checkpoints are intact: free space or fix the storage, then continue "
         "with --resume")]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1", "step-2"]   # .tmp-step-3 removed
    assert not (run / "run.lock").exists()
    erpo_train_here(run, root / "cache", "--max-steps", "3", "--resume")
    assert_same_metrics(metrics_by_step(run), metrics_by_step(root / "full"))


def test_a_damaged_newest_checkpoint_is_skipped_with_one_warning_and_the_run_still_matches(runs, caplog):
    root, _ = runs
    run = root / "truncated"
    shutil.copytree(root / "pristine", run)
    truncate(run / "checkpoints" / "step-2" / "optimizer.pt")
    caplog.set_level("INFO", logger="erpo")
    erpo_train_here(run, root / "cache", "--max-steps", "3", "--resume")   # what it reads is the files, not a process
    warnings = [r for r in caplog.records if "damaged" in r.getMessage()]
    assert [r.levelname for r in warnings] == ["WARNING"], [r.getMessage() for r in warnings]
    assert f"checkpoint {run / 'checkpoints' / 'step-2'} is damaged (optimizer.pt: " in warnings[0].getMessage()
    assert "moved to damaged-step-2; resuming from an older one" in warnings[0].getMessage()
    assert any(f"resumed from {run / 'checkpoints' / 'step-1'}" in r.getMessage() for r in caplog.records)
    assert_same_metrics(metrics_by_step(run), metrics_by_step(root / "full"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["damaged-step-2", "step-2", "step-3"]


def test_no_intact_checkpoint_is_one_line_and_exit_1(runs, capsys):
    root, _ = runs
    run = root / "all-damaged"
    shutil.copytree(root / "pristine", run)
    for step in (1, 2):   # same sizes: only the digests, checked once the models are built, can tell
        flip_bit(run / "checkpoints" / f"step-{step}" / "model.pt")
    assert refused_here(run, root / "cache", capsys) == [
        (f"erpo train: no intact checkpoint under {run / 'checkpoints'}: step-2: model.pt: its content does not "
         "match its sha256 (bit rot or an overwritten file); step-1: model.pt: its content does not match its sha256 "
         "(bit rot or an overwritten file); restore them from a copy, or start a fresh run in another --output-dir")]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1", "step-2"]


def test_a_second_writer_is_refused_until_the_first_is_killed(runs, capsys, caplog):
    root, _ = runs
    run = root / "locked"
    # alive, holding the lock and making no progress until killed: step-1 is saved, step 2 cannot end
    first = start_held_run(run, root / "cache", root / "locked-hold", "--max-steps", "3", step=2)
    try:
        [line] = refused_here(run, root / "cache", capsys, sets=HELD_REWARD)   # the same run's command line
        assert line.startswith(f"erpo train: --output-dir {run}: another run is writing it (host ")
        assert f", pid {first.pid}, since " in line
        first.kill()
        assert first.wait(timeout=30) == -signal.SIGKILL
    finally:
        first.kill()
        first.stderr.close()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]
    caplog.set_level("INFO", logger="erpo")
    erpo_train_here(run, root / "cache", "--max-steps", "3", "--resume", sets=HELD_REWARD)   # nothing held
    [takeover] = [r.getMessage() for r in caplog.records if "taking over the lock" in r.getMessage()]
    assert f"(its process {first.pid} is gone)" in takeover
    assert_same_metrics(metrics_by_step(run), metrics_by_step(root / "full"))
    assert not (run / "run.lock").exists()
