"""`python -m bench.trl_step_time`'s evidence that does not move with a shared machine's load: ERPOTrainer's step
runs the model exactly as often as GRPOTrainer's (2026-11-27, trlperf: a median 2x slower at beta=0 on the CPU was
other processes' load, not more work). It times nothing that is asserted on."""
import re
import sys
import tempfile

import pytest
import torch

pytest.importorskip("trl", exc_type=ModuleNotFoundError)
pytest.importorskip("datasets", exc_type=ModuleNotFoundError)

from bench import trl_step_time  # noqa: E402

NUMBER = r"\d+\.\d+"


def test_erpo_runs_the_model_as_often_as_grpo(tmp_path, monkeypatch, capsys):
    """Per step, at beta=0 and 0.04, both trainers: 24 forwards of the policy without gradient (generation of 24
    tokens: the prompt, then one per new token but the last; no old log-probs with num_iterations=1), one with
    gradient (the loss's: ERPO scores the prompt rows in it, no second pass over the prompts, no ell_theta0(q)
    forward after the construction), and at beta=0.04 one of TRL's reference model (ERPO's Query-KL needs none).
    An extra forward in either trainer's step changes a count."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # the model and each run's output_dir
    monkeypatch.setattr(sys, "argv", ["trl_step_time", "--steps", "2", "--repeats", "1",
                                      "--threads", str(torch.get_num_threads())])
    trl_step_time.main()
    table = capsys.readouterr().out
    rows = {(name, float(beta)): forwards for name, beta, forwards in re.findall(
        rf"^\| (GRPO|ERPO) \| ([\d.]+) \| {NUMBER} \| {NUMBER} \| {NUMBER} \| ([\d +]+) \| {NUMBER} \|$", table,
        re.MULTILINE)}
    assert rows == {("GRPO", 0.0): "24 + 1 + 0", ("ERPO", 0.0): "24 + 1 + 0",
                    ("GRPO", 0.04): "24 + 1 + 1", ("ERPO", 0.04): "24 + 1 + 1"}, table
    assert re.search(rf"^fastest step: ERPO/GRPO at beta=0: {NUMBER}", table, re.MULTILINE), table


def test_fewer_than_two_steps_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["trl_step_time", "--steps", "1"])
    with pytest.raises(SystemExit, match="^2$"):   # argparse's usage error, before any model is built
        trl_step_time.main()
    assert capsys.readouterr().err.splitlines()[-1] == (
        "trl_step_time: error: --steps 1: at least 2 (the first step is dropped as warm-up)")
