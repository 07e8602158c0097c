"""`erpo compare`: several algorithms x seeds in one command, a table of mean and spread, finished runs reused."""
import json
import logging
import os
import statistics

import pytest

from erpo.cli.commands import main
from erpo.cli.compare import render, window_means

SMALL = ["tiny.hidden_size=16", "tiny.intermediate_size=32", "tiny.num_layers=1", "tiny.num_heads=2",
         "tiny.num_kv_heads=1", "tiny.sft_steps=5", "tiny.sft_examples=16", "data.num_examples=8",
         "trainer.rollout_batch_size=2", "trainer.update_batch_size=2", "trainer.micro_batch_size=4", "rollout.n=2",
         "rollout.max_new_tokens=4", "logging.tensorboard=false", "logging.progress_bar=false", "logging.plot=false",
         "trainer.save_hf=false", "trainer.save_steps=1", "trainer.keep_last=2"]


def test_window_means():
    records = [{"reward": r, "accuracy": r, "qkl": None if i == 0 else r / 10} for i, r in enumerate([1.0, 2, 3, 4])]
    means = window_means(records, 2)
    assert means["reward first"] == 1.5 and means["reward last"] == 3.5
    assert means["qkl first"] == pytest.approx(0.25) and means["qkl last"] == pytest.approx(0.35)  # None skipped
    assert window_means(records, 10)["reward first"] == window_means(records, 10)["reward last"] == 2.5


def test_a_short_run_s_report_says_how_many_steps_it_summarizes():
    # `erpo compare --max-steps 2` with the default --window 20: the windows are the 2 steps the runs logged
    records = [{"reward": r, "accuracy": r, "qkl": r / 10} for r in (0.25, 0.5)]
    results = {"erpo": {1: {**window_means(records, 20), "wall_s": 1.0}}}
    table = render(results, ["erpo"], [1], 20, {})
    assert "average over its first / last 2 optimizer steps; each run logged 2 optimizer steps (no more than " \
           "--window 20: its first and last windows are the same steps, the whole run)." in table
    assert "| reward, first 2 steps | reward, last 2 steps |" in table and "20 steps" not in table
    assert "| erpo seed 1 | 2 | 0.3750 | 0.3750 |" in table
    longer = {"erpo": {1: {**window_means(records * 15, 20), "wall_s": 1.0}}}   # 30 steps: the windows overlap
    assert "each run logged 30 optimizer steps (fewer than 2 x --window 20: its first and last windows overlap)." \
        in render(longer, ["erpo"], [1], 20, {})
    uneven = {"erpo": {1: {**window_means(records, 20), "wall_s": 1.0}, 2: {**window_means(records * 20, 20),
                                                                          "wall_s": 1.0}}}
    assert "first / last ≤ 20 optimizer steps; each run logged 2 to 40 optimizer steps" in \
        render(uneven, ["erpo"], [1, 2], 20, {})


def test_compare_two_algorithms_two_seeds(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--seeds", "1", "2", "--algorithms", "erpo", "grpo", "--max-steps", "2", "--window", "1",
            "--output-dir", str(out), "--set", f"model.cache_dir={tmp_path / 'cache'}", *SMALL]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    table = (out / "comparison.md").read_text()
    assert table in printed
    data = json.loads((out / "comparison.json").read_text())
    runs = data["runs"]
    assert sorted(runs) == ["erpo", "grpo"] and sorted(runs["erpo"]) == ["1", "2"]
    for algorithm in ("erpo", "grpo"):
        for seed in ("1", "2"):
            metrics = [json.loads(line) for line in (out / f"{algorithm}-seed{seed}" / "metrics.jsonl").open()]
            assert len(metrics) == 2
            assert runs[algorithm][seed]["reward first"] == metrics[0]["reward"]
            assert runs[algorithm][seed]["reward last"] == metrics[-1]["reward"]
        cfg = (out / f"{algorithm}-seed2" / "config.yaml").read_text()
        assert f"name: {algorithm}" in cfg and "seed: 2" in cfg
    last = [runs["erpo"][s]["qkl last"] for s in ("1", "2")]
    assert f"{statistics.fmean(last):.4f} ± {statistics.stdev(last):.4f}" in table
    diffs = [runs["erpo"][s]["reward last"] - runs["grpo"][s]["reward last"] for s in ("1", "2")]
    assert f"{statistics.fmean(diffs):+.4f}" in table
    assert "first / last 1 optimizer steps; each run logged 2 optimizer steps." in table
    assert "- command: erpo compare --seeds 1 2" in table and "- commit: " in table and "- machine: " in table

    # run again: every run is reused (nothing retrained), same numbers
    assert main(argv) == 0
    again = json.loads((out / "comparison.json").read_text())["runs"]
    assert all(again[a][s]["wall_s"] is None for a in again for s in again[a])
    assert {a: {s: {k: v for k, v in r.items() if k != "wall_s"} for s, r in by.items()} for a, by in again.items()} \
        == {a: {s: {k: v for k, v in r.items() if k != "wall_s"} for s, r in by.items()} for a, by in runs.items()}
    # an interrupted run is resumed from its newest checkpoint and ends as the uninterrupted one did
    import shutil
    interrupted = out / "grpo-seed2"
    shutil.rmtree(interrupted / "final")
    shutil.rmtree(interrupted / "checkpoints" / "step-2")
    assert main(argv) == 0
    resumed = json.loads((out / "comparison.json").read_text())["runs"]
    assert resumed["grpo"]["2"]["wall_s"] is not None and resumed["erpo"]["1"]["wall_s"] is None
    for key, value in runs["grpo"]["2"].items():
        if key != "wall_s":
            assert resumed["grpo"]["2"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    capsys.readouterr()
    # a finished run made with another config is not silently mixed in
    assert main(argv[:-1] + ["rollout.max_new_tokens=5"]) == 1
    assert "holds a finished run with another config" in capsys.readouterr().err


def test_a_run_stopped_by_sigterm_stops_the_comparison(tmp_path, monkeypatch, caplog):
    """A preemption's SIGTERM ends a run at a step boundary, unfinished (no final/), and `erpo train` exits 0: the
    comparison stops there too, tabulating nothing (it trained the next run and wrote comparison.md from the
    stopped one's first steps); the same command continues."""
    import erpo.distributed
    import erpo.train.loop
    trained = []

    def stopped_after_one_step(cfg, resume=False, force=False):   # what train does after a SIGTERM
        trained.append(cfg.output_dir)
        os.makedirs(cfg.output_dir, exist_ok=True)
        with open(os.path.join(cfg.output_dir, "metrics.jsonl"), "w") as handle:
            handle.write(json.dumps({"step": 1, "reward": 0.5, "accuracy": 0.5, "qkl": 0.0}) + "\n")
        return cfg.output_dir
    monkeypatch.setattr(erpo.train.loop, "train", stopped_after_one_step)
    monkeypatch.setattr(erpo.distributed, "destroy_distributed", lambda: None)
    out = tmp_path / "cmp"
    with caplog.at_level(logging.WARNING, logger="erpo"):
        assert main(["compare", "--output-dir", str(out)]) == 0
    assert trained == [str(out / "erpo-seed1")] and not (out / "comparison.md").exists()
    assert "erpo compare: erpo seed 1 stopped unfinished (a signal); the finished runs and this run's newest " \
           "checkpoint are kept: the same command continues" in caplog.text
