"""erpo.plotting: training-dynamics PNG from metrics.jsonl, the accuracy-vs-temperature PNG and accuracy over
training steps."""

import argparse
import json
import math

import matplotlib.image as mpimg
import numpy as np
import pytest

from erpo.cli import main
from erpo.cli.plot import add_plot_arguments, run_plot
from erpo.errors import UserError
from erpo.plotting import ema, plot_history, plot_runs, plot_temperature_curves, read_metrics


def _write_run(run_dir, steps, *, policy_kl=True, scale=1.0, torn_tail=False):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        lines.append(json.dumps({
            "step": step, "reward": scale * (1 - math.exp(-step / 10)), "accuracy": 0.5,
            "qkl": scale * 1e-3 * step, "policy_kl": 1e-4 * step if policy_kl else None,
            "entropy": 1.0 / (1 + step * scale), "loss": 0.1, "clip_ratio": 0.0, "completions/mean_length": 20.0,
            "grad_norm": 1.0, "lr": 1e-6,
        }))
    text = "\n".join(lines) + "\n"
    if torn_tail:
        text += '{"step": 999, "reward": 0.'  # crash while writing the last line
    (run_dir / "metrics.jsonl").write_text(text)
    return str(run_dir)


def _png(path):
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 300
    return image


def test_plot_runs_overlays_runs_and_writes_png(tmp_path):
    erpo_run = _write_run(tmp_path / "erpo", 40, policy_kl=False)
    grpo_run = _write_run(tmp_path / "grpo", 40, scale=2.0)
    out = tmp_path / "plots" / "dyn.png"
    assert plot_runs([erpo_run, grpo_run], str(out)) == str(out)
    both = _png(out)
    assert both.std() > 0.01  # not a blank canvas
    single = _png(plot_runs([grpo_run], str(tmp_path / "single.png")))
    assert both.shape == single.shape and not np.array_equal(both, single)  # the second run is drawn


def test_smoothing_is_the_debiased_ema_of_tensorboard():
    """Point k is the average of the values so far, value i weighted by (1 - w) w^(k - i): no pull toward the first
    value (an EMA started at it) nor toward 0 (an EMA started at 0 and not debiased)."""
    values, w = [1.0, 3.0, 2.0, 5.0, -1.0], 0.6
    expected = []
    for k in range(1, len(values) + 1):
        weights = [(1 - w) * w ** (k - i) for i in range(1, k + 1)]
        expected.append(sum(wt * v for wt, v in zip(weights, values)) / sum(weights))
    assert ema(values, w) == pytest.approx(expected, rel=1e-12)
    assert ema(values, w)[1] == pytest.approx(2.25)   # (0.4 * 0.6 * 1 + 0.4 * 3) / (1 - 0.6 ** 2)
    assert ema([4.0] * 6, 0.9) == pytest.approx([4.0] * 6)
    assert ema(values, 0.0) == values


def test_plot_runs_smoothing_and_labels(tmp_path):
    run = _write_run(tmp_path / "run", 50)
    raw = _png(plot_runs([run], str(tmp_path / "raw.png")))
    smooth = _png(plot_runs([run], str(tmp_path / "smooth.png"), labels=["ERPO"], smooth=0.9))
    assert not np.array_equal(raw, smooth)
    with pytest.raises(ValueError, match="smooth"):
        plot_runs([run], str(tmp_path / "x.png"), smooth=1.0)
    with pytest.raises(ValueError, match="labels"):
        plot_runs([run], str(tmp_path / "x.png"), labels=["a", "b"])
    with pytest.raises(ValueError, match="non-empty list"):
        plot_runs([], str(tmp_path / "x.png"))
    with pytest.raises(FileNotFoundError):
        plot_runs([str(tmp_path / "absent")], str(tmp_path / "x.png"))


def test_read_metrics_resume_and_torn_line(tmp_path):
    run = _write_run(tmp_path / "run", 5, torn_tail=True)
    records = read_metrics(f"{run}/metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    # A resumed run logs steps 4-5 again: the later record wins, steps stay sorted.
    path = tmp_path / "resumed.jsonl"
    path.write_text("\n".join(json.dumps({"step": s, "reward": r}) for s, r in
                              [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (2, 0.25), (3, 0.35)]) + "\n")
    assert [(r["step"], r["reward"]) for r in read_metrics(str(path))] == [(1, 0.1), (2, 0.25), (3, 0.35), (4, 0.4)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\n{oops\n{"step": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_metrics(str(bad))


def test_a_run_logged_before_the_trl_names_reads_and_plots_under_them(tmp_path):
    """A metrics.jsonl written before response_length and truncated_frac took TRL's names: read_metrics (what
    `erpo plot` and `erpo compare` read) gives their values under completions/mean_length and
    completions/clipped_ratio, the other keys as they were, and the run plots beside a new one."""
    old = tmp_path / "old"
    old.mkdir()
    lines = [{"step": step, "reward": 0.1 * step, "qkl": 0.01, "policy_kl": None, "entropy": 0.5,
              "response_length": 10.0 + step, "truncated_frac": step / 8} for step in (1, 2, 3)]
    (old / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = read_metrics(str(old / "metrics.jsonl"))
    assert records == [{"step": r["step"], "reward": r["reward"], "qkl": 0.01, "policy_kl": None, "entropy": 0.5,
                        "completions/mean_length": r["response_length"],
                        "completions/clipped_ratio": r["truncated_frac"]} for r in lines]
    _png(plot_runs([str(old), _write_run(tmp_path / "new", 3)], str(tmp_path / "both.png")))


def test_run_plot_cli_default_output(tmp_path, capsys):
    run = _write_run(tmp_path / "run", 10)
    parser = argparse.ArgumentParser()
    add_plot_arguments(parser)
    run_plot(parser.parse_args([run]))
    expected = tmp_path / "run" / "plots" / "training_dynamics.png"
    assert capsys.readouterr().out.strip() == str(expected)
    _png(expected)
    other = _write_run(tmp_path / "other", 10, scale=3.0)
    out = tmp_path / "cmp.png"
    run_plot(parser.parse_args([run, other, "-o", str(out), "--labels", "a,b", "--smooth", "0.5"]))
    _png(out)


def test_plot_temperature_curves(tmp_path):
    curves = {"Avg@4": {"sft": {0.1: 0.2, 1.0: 0.3, 1.5: 0.1}, "erpo": {0.1: 0.5, 1.0: 0.6, 1.5: 0.4}},
              "Pass@1": {"sft": {0.1: 0.25, 1.0: 0.3, 1.5: 0.0}, "erpo": {0.1: 0.5, 1.0: 0.5, 1.5: 0.5}}}
    image = _png(plot_temperature_curves(curves, str(tmp_path / "t.png")))
    assert image.shape[1] > image.shape[0]  # panels side by side
    with pytest.raises(ValueError):
        plot_temperature_curves({}, str(tmp_path / "t.png"))


def test_plot_history_one_panel_per_run(tmp_path):
    curves = {run: {0.6: {0: 0.2, 100: 0.4, 200: 0.5}, 1.5: {0: 0.1, 100: 0.05, 200: 0.0}}
              for run in ("erpo", "grpo", "grpo beta=0")}
    wide = _png(plot_history(curves, str(tmp_path / "h.png"), metric="Avg@8"))
    narrow = _png(plot_history({"erpo": curves["erpo"]}, str(tmp_path / "one.png"), metric="Avg@8"))
    assert wide.shape[0] == narrow.shape[0] and wide.shape[1] == 3 * narrow.shape[1]   # runs side by side
    with pytest.raises(ValueError, match="at least one run"):
        plot_history({}, str(tmp_path / "h.png"), metric="Avg@8")


def test_erpo_plot_command(tmp_path):
    run = _write_run(tmp_path / "run", 8)
    out = tmp_path / "from_cli.png"
    assert main(["plot", run, "--output", str(out)]) == 0
    _png(out)


def test_erpo_plot_unwritable_output_names_the_option(tmp_path, capsys):
    run = _write_run(tmp_path / "run", 8)
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the output's folder would be
    out = blocked / "plots" / "x.png"
    assert main(["plot", run, "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"erpo plot: --output {out}: cannot write it (") and str(blocked) in err
    assert len(err.strip().splitlines()) == 1


def test_erpo_plot_missing_run_is_a_user_error(tmp_path, capsys):
    """A missing run is erpo's one user-error path: one line from `erpo plot`, the traceback with --debug."""
    parser = argparse.ArgumentParser()
    add_plot_arguments(parser)
    with pytest.raises(UserError, match="no metrics file"):
        run_plot(parser.parse_args([str(tmp_path / "absent")]))
    assert main(["plot", str(tmp_path / "absent")]) == 1
    assert capsys.readouterr().err.startswith("erpo plot: no metrics file")
    with pytest.raises(UserError, match="no metrics file"):
        main(["plot", str(tmp_path / "absent"), "--debug"])
