"""A run's history end to end: a short tiny run keeping every 2nd step's checkpoint (trainer.keep_every), then
`erpo eval --model NAME=RUN_DIR@all` over two temperatures: history.md / .csv (step x temperature), the figure, the
sample cache reused by a second evaluation, and `erpo compare --eval-history`."""
import csv
import os

import pytest

from erpo.cli.commands import main
from erpo.eval.model_specs import parse_models
from erpo.rollout.hf import HFRollout

SMALL = ["tiny.hidden_size=16", "tiny.intermediate_size=32", "tiny.num_layers=1", "tiny.num_heads=2",
         "tiny.num_kv_heads=1", "tiny.sft_steps=5", "tiny.sft_examples=16", "data.num_examples=8",
         "trainer.rollout_batch_size=2", "trainer.update_batch_size=2", "trainer.micro_batch_size=4", "rollout.n=2",
         "rollout.max_new_tokens=4", "logging.tensorboard=false", "logging.progress_bar=false", "logging.plot=false"]
HISTORY = ["trainer.save_steps=1", "trainer.keep_last=1", "trainer.keep_every=2"]
EVAL = ["--benchmarks", "synthetic#n=3", "--temperatures", "0.6,1.2", "--k", "2", "--max-new-tokens", "4",
        "--no-progress", "--device", "cpu", "--engine", "hf"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 5-step tiny run saving every step, keeping the newest and every 2nd: steps 2, 4 and 5 remain."""
    root = tmp_path_factory.mktemp("history")
    out = root / "run"
    assert main(["train", "--max-steps", "5", "--output-dir", str(out), "--set", f"model.cache_dir={root / 'cache'}",
                 *SMALL, *HISTORY]) == 0
    return out


def read_history(out):
    with open(out / "history.csv") as handle:
        return list(csv.DictReader(handle))


def test_keep_every_leaves_the_history_and_all_expands_to_it(run_dir):
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2", "step-4", "step-5"]
    models = parse_models([f"erpo={run_dir}@all"])
    assert [(m.label, m.history, m.step) for m in models] == [
        ("erpo@start", "erpo", 0), ("erpo@step-2", "erpo", 2), ("erpo@step-4", "erpo", 4), ("erpo@step-5", "erpo", 5)]
    assert models[1].path == str(run_dir / "checkpoints" / "step-2" / "hf")
    assert parse_models([f"{run_dir}@all"])[0].label == "run@start"   # default label: the run dir's name


def test_eval_over_the_history_writes_the_step_by_temperature_table(run_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "eval"
    assert main(["eval", "--model", f"erpo={run_dir}@all", "--output-dir", str(out), *EVAL]) == 0
    printed = capsys.readouterr().out
    markdown = (out / "history.md").read_text()
    assert markdown in printed
    assert "| step | T=0.6 | T=1.2 | mean all | mean <=1.0 | mean 1.2-1.5 |" in markdown
    assert [line.split(" |")[0] for line in markdown.splitlines() if line.startswith("| ") and
            line[2].isdigit()] == ["| 0", "| 2", "| 4", "| 5"]
    history = read_history(out)
    assert [(r["run"], r["step"], r["temperature"]) for r in history if r["temperature"] in ("0.6", "1.2")] == [
        ("erpo", str(s), t) for s in (0, 2, 4, 5) for t in ("0.6", "1.2")]
    assert {"avg@2", "pass@2", "pass@1"} <= set(history[0])
    # the table holds the scores results.csv has for the same model and temperature
    with open(out / "results.csv") as handle:
        results = {(r["model"], r["temperature"]): r["avg@2"] for r in csv.DictReader(handle)
                   if r["benchmark"] == "Avg."}
    for r in history:
        label = "erpo@start" if r["step"] == "0" else f"erpo@step-{r['step']}"
        assert float(r["avg@2"]) == float(results[(label, r["temperature"])])
    assert (out / "accuracy_over_steps.png").stat().st_size > 10_000

    # a second evaluation samples nothing: every sample comes from the cache, same table
    def no_sampling(*args, **kwargs):
        raise AssertionError("sampled again instead of reading the cache")
    monkeypatch.setattr(HFRollout, "generate", no_sampling)
    assert main(["eval", "--model", f"erpo={run_dir}@all", "--output-dir", str(out), *EVAL]) == 0
    assert read_history(out) == history


def test_history_of_a_run_without_checkpoints_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    assert main(["eval", "--model", f"{run}@all", "--output-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"erpo eval: --model {run}@all: {run} holds no complete checkpoint") and err.count("\n") == 1
    assert main(["eval", "--model", f"{tmp_path}@all"]) == 1
    assert "is not a training output dir (no config.yaml)" in capsys.readouterr().err


def test_compare_evaluates_its_runs_histories(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--algorithms", "erpo", "grpo", "--seeds", "1", "--max-steps", "2", "--output-dir",
                 str(out), "--set", f"model.cache_dir={tmp_path / 'cache'}", *SMALL, "trainer.save_steps=1",
                 "trainer.keep_last=1", "trainer.keep_every=1", "--eval-history", "--eval-temperatures", "1.0",
                 "--eval-k", "1", "--eval-benchmarks", "synthetic#n=2"]) == 0
    capsys.readouterr()
    history = read_history(out / "history")
    assert [(r["run"], r["step"]) for r in history if r["temperature"] == "1.0"] == [
        (run, str(s)) for run in ("erpo-seed1", "grpo-seed1") for s in (0, 1, 2)]
    assert os.path.isfile(out / "history" / "accuracy_over_steps.png")


@pytest.mark.parametrize("option,value,message", [
    ("--eval-temperatures", "0.6,hot", "--eval-temperatures must be comma-separated numbers"),
    ("--eval-k", "0", "--eval-k must be an integer >= 1 (samples per problem), got 0"),
    ("--eval-temperatures", "0.6,9", "--eval-temperatures: each temperature must be in (0, 5], got 9"),
    ("--eval-benchmarks", "nope.csv", "is not a file"),
])
def test_compare_checks_the_eval_options_before_training(tmp_path, capsys, option, value, message):
    out = tmp_path / "cmp"
    assert main(["compare", "--output-dir", str(out), "--eval-history", option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("erpo compare: --eval-history: ") and message in err and err.count("\n") == 1
    assert not out.exists()   # nothing trained
