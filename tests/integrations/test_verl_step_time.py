"""`python -m bench.verl_step_time` runs on a machine without a GPU: in a fresh process of its own, where verl is
imported by the bench module first (until 2026-11-27 verl picked its CUDA platform before bench.verl_engine had
selected the CPU one, and the run died in `torch._C._cuda_setDevice`). It times nothing that is asserted on."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from paths import worker_pythonpath

# verl (and tensordict) through bench.verl_engine, which sets verl's CPU platform before verl is imported: verl keeps
# its platform for the process, and importing it first here chose 'nvidia' for every later verl test of the run
pytest.importorskip("bench.verl_engine", exc_type=ModuleNotFoundError)

REPO = Path(__file__).resolve().parents[2]
NUMBER = r"(\d+\.\d+)"


@pytest.mark.cpu_only
def test_the_cpu_smoke_run_times_both_losses(tmp_path):
    env = {**os.environ, "PYTHONPATH": worker_pythonpath(), "TMPDIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "bench.verl_step_time", "--pairs", "2"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for name in ("verl ppo_loss", "erpo_ppo_loss"):
        row = re.search(rf"^\| {name} \| {NUMBER} \| {NUMBER}-{NUMBER} \|$", done.stdout, re.MULTILINE)
        assert row and 0 < float(row[2]) <= float(row[1]) <= float(row[3]), done.stdout
    assert re.search(rf"per-pair ratio erpo / verl: median {NUMBER}", done.stdout)
    assert re.search(rf"loss alone, .*verl ppo_loss {NUMBER} ms, erpo_ppo_loss {NUMBER} ms", done.stdout)


def test_fewer_than_two_pairs_is_a_usage_error(monkeypatch, capsys):
    from bench import verl_step_time
    monkeypatch.setattr(sys, "argv", ["verl_step_time", "--pairs", "1"])
    with pytest.raises(SystemExit) as exit_info:
        verl_step_time.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "verl_step_time: error: --pairs 1: at least 2 (the per-pair ratio's quartiles need two pairs)")
