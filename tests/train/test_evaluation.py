"""erpo.eval.evaluate: model resolution, the sample cache and resume, scores, tables, the `erpo eval` entry."""

import argparse
import csv
import json
import os
import re

import pytest
import yaml

from erpo.cli.eval import add_eval_arguments, run_eval
from erpo.config import Config, to_dict
from erpo.errors import UserError
from erpo.eval import evaluate as evaluation
from erpo.eval.defaults import DEFAULT_MAX_NEW_TOKENS, TEMPERATURE_GRIDS
from erpo.eval.evaluate import evaluate
from erpo.eval.metrics import pass_at_k
from erpo.eval.model_specs import parse_models, parse_templates, prompt_settings, resolve_model
from erpo.eval.problem_sets import load_benchmark, load_benchmarks
from erpo.eval.sample_cache import append_lines, read_cache
from erpo.eval.tables import BENCHMARK_AVERAGE, aggregate, range_members
from erpo.models.tiny import build_model, build_tokenizer
from erpo.rollout.engine import RolloutBatch, RolloutEngine
from erpo.rollout.hf import HFRollout
from erpo.tasks import rewards
from erpo.train.checkpoint import CheckpointManager, TorchBundle

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "benchmarks")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny (untrained) model + tokenizer, as `save_pretrained` leaves them."""
    path = tmp_path_factory.mktemp("tiny") / "model"
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _run_dir(root, model_path, *, template="plain", max_new_tokens=6, with_final=True):
    """A training output dir: config.yaml (starting from model_path) and final/ (a copy of the model)."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = to_dict(Config())
    cfg["model"]["name_or_path"] = model_path
    cfg["data"]["template"] = template
    cfg["rollout"]["max_new_tokens"] = max_new_tokens
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    if with_final:
        final = root / "final"
        final.mkdir()
        for name in os.listdir(model_path):
            (final / name).write_bytes(open(os.path.join(model_path, name), "rb").read())
    return str(root)


# --------------------------------------------------------------------------------------------------
# Model resolution
# --------------------------------------------------------------------------------------------------
def test_resolve_model_paths(tmp_path, tiny_model_dir, monkeypatch):
    run = _run_dir(tmp_path / "my-run", tiny_model_dir)
    spec = resolve_model(run)
    assert (spec.label, spec.path, spec.run_dir) == ("my-run", os.path.join(run, "final"), run)
    start = resolve_model(run + "@start")
    assert (start.label, start.path, start.run_dir) == ("my-run@start", tiny_model_dir, run)
    plain = resolve_model(f"base={tiny_model_dir}")
    assert (plain.label, plain.path, plain.run_dir) == ("base", tiny_model_dir, None)
    monkeypatch.setattr("erpo.models.source._hub_problem", lambda name: None)   # as if the Hub served it
    assert resolve_model("Qwen/Qwen2.5-Math-7B").path == "Qwen/Qwen2.5-Math-7B"  # Hub name, loaded later

    unfinished = _run_dir(tmp_path / "unfinished", tiny_model_dir, with_final=False)
    with pytest.raises(ValueError, match="final/config.json"):
        resolve_model(unfinished)
    with pytest.raises(ValueError, match="no such local directory"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.yaml"):
        resolve_model(tiny_model_dir + "@start")
    with pytest.raises(ValueError, match="unique"):
        parse_models([f"{tiny_model_dir},{tiny_model_dir}"])
    assert [m.label for m in parse_models([f"a={tiny_model_dir},b={tiny_model_dir}", run])] == ["a", "b", "my-run"]


def test_checkpoint_dirs_resolve_to_their_hf_export(tmp_path, tiny_model_dir):
    run = _run_dir(tmp_path / "my-run", tiny_model_dir, max_new_tokens=3, with_final=False)
    tokenizer = build_tokenizer()
    manager = CheckpointManager(run, keep_last=None)
    bundle = TorchBundle(build_model(tokenizer, seed=0, hidden_size=16, intermediate_size=32, num_layers=1))
    step2 = manager.save(2, bundle, {}, export=True, tokenizer=tokenizer)
    spec = resolve_model(step2 + "/")
    assert (spec.label, spec.path, spec.run_dir) == ("my-run@step-2", os.path.join(step2, "hf"), run)
    assert prompt_settings(spec, None, 3).template == "plain"              # the run's prompt format
    assert resolve_model(f"ck={step2}").label == "ck"
    with pytest.raises(ValueError, match=r"no Hugging Face export \(hf/config.json\).*trainer.save_hf=false"):
        resolve_model(manager.save(3, bundle, {}))
    with pytest.raises(ValueError, match="checkpoints/step-N"):
        resolve_model(run)                                                 # unfinished: no final/
    result = evaluate([spec], [load_benchmark("synthetic#n=2")], temperatures=[1.0], k=2, max_new_tokens=3,
                      output_dir=str(tmp_path / "out"), progress=False)
    assert {r["model"] for r in result["rows"]} == {"my-run@step-2"}
    assert all(r["mean_response_tokens"] <= 3 for r in result["rows"])


def test_prompt_settings_follow_the_run_and_one_budget(tmp_path, tiny_model_dir):
    """The run's prompt format, unless overridden; one response budget for every model, whatever a run used."""
    run = resolve_model(_run_dir(tmp_path / "run", tiny_model_dir, template="plain", max_new_tokens=7))
    settings = prompt_settings(run, None, 3000)
    assert (settings.template, settings.use_chat_template, settings.max_new_tokens) == ("plain", True, 3000)
    settings = prompt_settings(run, "paper", 9)
    assert (settings.template, settings.max_new_tokens) == ("paper", 9)
    default = prompt_settings(resolve_model(tiny_model_dir), None, 3000)
    assert (default.template, default.use_chat_template) == ("paper", True)
    base = prompt_settings(resolve_model(tiny_model_dir), "qwen-math", 3000)   # Dr.GRPO's base-model prompt
    assert base.template.startswith("<|im_start|>system\nPlease reason step by step") and not base.use_chat_template
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    defaults = parser.parse_args(["--model", "m"])
    assert defaults.max_new_tokens == 3000 and DEFAULT_MAX_NEW_TOKENS == 3000


def test_templates_per_model():
    labels = ["base", "erpo", "grpo"]
    assert parse_templates(["base=qwen-math"], labels) == {"base": "qwen-math"}
    assert parse_templates(["base=qwen-math", "paper"], labels) == {
        "base": "qwen-math", "erpo": "paper", "grpo": "paper"}
    assert parse_templates(["Q: {problem} = ?"], labels) == {label: "Q: {problem} = ?" for label in labels}
    with pytest.raises(ValueError, match="LABEL=TEMPLATE"):
        parse_templates(["paper", "plain"], labels)


def test_paper_temperature_grid():
    """The paper's grid: 10 temperatures 0.1..1.0 (the "<= 1.0" mean) and 1.2..1.5 (the "1.2-1.5" mean)."""
    grid = TEMPERATURE_GRIDS["paper"]
    ranges = range_members(grid)
    assert ranges["<=1.0"] == [round(0.1 * i, 1) for i in range(1, 11)]
    assert ranges["1.2-1.5"] == [1.2, 1.3, 1.4, 1.5] and ranges["all"] == list(grid)
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    assert parser.parse_args(["--model", "m"]).temperatures == "paper"


def test_tensor_parallel_needs_vllm(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=2 needs the vLLM engine \(engine=vllm, "):   # keywords
        evaluation.build_engine(tiny_model_dir, engine="hf", device="cpu", dtype="auto", seed=0, batch_size=1,
                                tensor_parallel_size=2)


# --------------------------------------------------------------------------------------------------
# Exact scores through the whole pipeline with a scripted engine
# --------------------------------------------------------------------------------------------------
class ScriptedEngine(RolloutEngine):
    """Answers problem "a+b=?" / "a-b=?": sample j is right iff j < correct_count(a, temperature)."""

    seeding = "scripted"   # its samples do not depend on the seed

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0

    @staticmethod
    def correct_count(a, k, temperature):
        return 0 if temperature > 1.0 else a % (k + 1)

    def generate(self, prompt_ids, *, n, temperature, top_p=1.0, max_new_tokens, seed=None):
        self.calls += 1
        batch = RolloutBatch([], [], [], None, [])
        for i, ids in enumerate(prompt_ids):
            a, op, b = re.search(r"(\d+)([+-])(\d+)=\?", self.tokenizer.decode(ids)).groups()
            gold = int(a) + int(b) if op == "+" else int(a) - int(b)
            for j in range(n):
                answer = gold if j < self.correct_count(int(a), n, temperature) else gold + 1
                batch.prompt_index.append(i)
                batch.prompt_ids.append(ids)
                batch.response_ids.append(self.tokenizer(f"<think>.</think>\\boxed{{{answer}}}",
                                                         add_special_tokens=False)["input_ids"])
                batch.truncated.append(False)
        return batch

    def sync_weights(self, model):
        pass


def test_scores_match_hand_computation(tmp_path, tiny_model_dir, monkeypatch):
    tokenizer = build_tokenizer()
    monkeypatch.setattr(evaluation, "build_engine", lambda *a, **kw: (ScriptedEngine(tokenizer), tokenizer))
    k, temps = 4, [0.6, 1.0, 1.2, 1.5]
    benches = load_benchmarks(["s1=synthetic#n=7#seed=1", "s2=synthetic#n=5#seed=2"])
    result = evaluate(parse_models([f"m={tiny_model_dir}"]), benches, temperatures=temps, k=k,
                      output_dir=str(tmp_path), pass_ks=[2], batch_size=3, progress=False)
    rows = {(r["model"], r["benchmark"], str(r["temperature"])): r for r in result["rows"]}

    expected = {}
    for bench in benches:
        for t in temps:
            counts = [ScriptedEngine.correct_count(int(re.match(r"\d+", p["problem"]).group()), k, t)
                      for p in bench.problems]
            expected[(bench.name, t)] = {
                "avg@4": sum(c / k for c in counts) / len(counts),
                "pass@1": sum(c > 0 for c in counts) / len(counts),  # the first sample is right iff c > 0
                "pass@2": sum(pass_at_k(k, c, 2) for c in counts) / len(counts),
                "pass@4": sum(c > 0 for c in counts) / len(counts),
            }
            row = rows[("m", bench.name, str(t))]
            for key, value in expected[(bench.name, t)].items():
                assert row[key] == pytest.approx(value), (bench.name, t, key)
    assert any(v["avg@4"] > 0 for v in expected.values())  # the scripted engine is not all-wrong
    for t in temps:
        avg = rows[("m", BENCHMARK_AVERAGE, str(t))]
        assert avg["avg@4"] == pytest.approx((expected[("s1", t)]["avg@4"] + expected[("s2", t)]["avg@4"]) / 2)
    low, high, every = (rows[("m", BENCHMARK_AVERAGE, label)] for label in ("<=1.0", "1.2-1.5", "all"))
    assert high["avg@4"] == 0.0 and high["pass@4"] == 0.0
    assert low["avg@4"] == pytest.approx((rows[("m", BENCHMARK_AVERAGE, "0.6")]["avg@4"]
                                          + rows[("m", BENCHMARK_AVERAGE, "1.0")]["avg@4"]) / 2)
    assert every["avg@4"] == pytest.approx(low["avg@4"] / 2)


class ConstantEngine(RolloutEngine):
    """Answers every prompt with the same boxed text."""

    seeding = "constant"

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer = tokenizer, answer

    def generate(self, prompt_ids, *, n, temperature, top_p=1.0, max_new_tokens, seed=None):
        ids = self.tokenizer(f"<think>.</think>\\boxed{{{self.answer}}}", add_special_tokens=False)["input_ids"]
        rows = [(i, p) for i, p in enumerate(prompt_ids) for _ in range(n)]
        return RolloutBatch([i for i, _ in rows], [p for _, p in rows], [list(ids)] * len(rows), None,
                            [False] * len(rows))

    def sync_weights(self, model):
        pass


def test_any_gold_alternative_counts(tmp_path, tiny_model_dir, monkeypatch):
    """Minerva (Dr.GRPO's suite) lists alternatives: '0.02' is right for ['0.01', '0.02'], wrong for ['500']."""
    tokenizer = build_tokenizer()
    monkeypatch.setattr(evaluation, "build_engine", lambda *a, **kw: (ConstantEngine(tokenizer, "0.02"), tokenizer))
    bench = load_benchmark(os.path.join(FIXTURES, "minerva_alternatives.jsonl"))
    result = evaluate(parse_models([f"m={tiny_model_dir}"]), [bench], temperatures=[1.0], k=2,
                      output_dir=str(tmp_path), progress=False)
    row = next(r for r in result["rows"] if r["benchmark"] == "minerva_alternatives" and r["temperature"] == 1.0)
    assert row["avg@2"] == pytest.approx(0.5) and row["pass@1"] == pytest.approx(0.5)


def test_aggregate_hand_rows():
    rows = [{"model": "m", "benchmark": b, "temperature": t, "x": x}
            for b, t, x in [("a", 0.5, 0.2), ("a", 1.5, 0.0), ("b", 0.5, 0.6), ("b", 1.5, 0.4)]]
    out = {(r["benchmark"], r["temperature"]): r["x"] for r in aggregate(rows, ["x"])}
    assert out[(BENCHMARK_AVERAGE, 0.5)] == pytest.approx(0.4)
    assert out[(BENCHMARK_AVERAGE, 1.5)] == pytest.approx(0.2)
    assert out[("a", "<=1.0")] == pytest.approx(0.2) and out[("a", "1.2-1.5")] == 0.0
    assert out[(BENCHMARK_AVERAGE, "all")] == pytest.approx(0.3)


# --------------------------------------------------------------------------------------------------
# The real tiny model: cache, resume, outputs, CLI
# --------------------------------------------------------------------------------------------------
def _cache_records(output_dir):
    records = {}
    for root, _, files in os.walk(os.path.join(output_dir, "samples")):
        for name in files:
            if name.endswith(".jsonl"):
                rel = os.path.relpath(os.path.join(root, name), output_dir)
                records[rel] = read_cache(os.path.join(root, name), k=3)
    return records


def test_interrupted_eval_resumes_to_the_same_result(tmp_path, tiny_model_dir, monkeypatch):
    kwargs = dict(temperatures=[0.7, 1.3], k=3, max_new_tokens=5, batch_size=2, progress=False)
    benches = [load_benchmark("synthetic#n=5")]
    models = parse_models([tiny_model_dir])
    full = evaluate(models, benches, output_dir=str(tmp_path / "full"), **kwargs)

    calls = {"n": 0}
    real_generate = HFRollout.generate

    def crashing_generate(self, *args, **kw):
        calls["n"] += 1
        if calls["n"] == 4:  # 3 chunks per temperature: dies in the second temperature
            raise KeyboardInterrupt
        return real_generate(self, *args, **kw)

    monkeypatch.setattr(HFRollout, "generate", crashing_generate)
    out = str(tmp_path / "resumed")
    with pytest.raises(KeyboardInterrupt):
        evaluate(models, benches, output_dir=out, **kwargs)
    partial = _cache_records(out)
    done_first = sum(len(v) for v in partial.values())
    assert done_first == 5  # the first temperature is complete, the second holds nothing
    # A crash while writing leaves a torn line: resume must skip it.
    torn = os.path.join(out, "samples", "model", "synthetic", "temp-1.3.jsonl")
    with open(torn, "a") as handle:
        handle.write('{"id": 4, "sample": 0, "compl')

    calls["n"] = -100  # no more crashes; count the generate calls the resume needs
    resumed = evaluate(models, benches, output_dir=out, **kwargs)
    assert calls["n"] == -100 + 3  # only the 3 chunks of the unfinished temperature
    assert _cache_records(out) == _cache_records(str(tmp_path / "full"))
    assert resumed["rows"] == full["rows"]

    calls["n"] = -100
    evaluate(models, benches, output_dir=out, **kwargs)  # everything cached: no generation at all
    assert calls["n"] == -100


def test_append_cuts_a_torn_tail_after_complete_lines(tmp_path):
    path = str(tmp_path / "samples" / "temp-1.jsonl")
    append_lines(path, [{"id": 0, "sample": 0}])
    with open(path, "a") as handle:
        handle.write('{"id": 1, "sam')  # a crash mid-write
    append_lines(path, [{"id": 1, "sample": 0}])
    with open(path) as handle:
        assert handle.read() == '{"id": 0, "sample": 0}\n{"id": 1, "sample": 0}\n'
    append_lines(path, [{"id": 2, "sample": 0}])  # an intact file is only appended to
    assert read_cache(path, 1) == {i: [{"id": i, "sample": 0}] for i in range(3)}



def test_cache_keeps_completions_with_unicode_line_separators(tmp_path):
    # json.dumps(ensure_ascii=False) leaves U+2028 / U+0085 unescaped; they must not split a cache line.
    path = str(tmp_path / "temp-1.jsonl")
    records = [{"id": 0, "sample": 0, "completion": "a\u2028b\x85c\u2029"}, {"id": 1, "sample": 0, "completion": "d"}]
    append_lines(path, records)
    assert read_cache(path, 1) == {0: [records[0]], 1: [records[1]]}


def test_cache_refuses_other_settings(tmp_path, tiny_model_dir):
    models, benches = parse_models([tiny_model_dir]), [load_benchmark("synthetic#n=2")]
    evaluate(models, benches, output_dir=str(tmp_path), temperatures=[1.0], k=2, max_new_tokens=3, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        evaluate(models, benches, output_dir=str(tmp_path), temperatures=[1.0], k=2, max_new_tokens=4,
                 progress=False)
    with pytest.raises(ValueError, match=r"different settings \(dtype\)"):   # samples of another precision
        evaluate(models, benches, output_dir=str(tmp_path), temperatures=[1.0], k=2, max_new_tokens=3,
                 dtype="float64", progress=False)



def test_cache_refuses_samples_of_a_model_changed_in_place(tmp_path, tiny_model_dir):
    """A model saved again at the same path (a run resumed to more steps rewrites its final/) is another model: its
    cached samples are refused, not served as the new model's."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in os.listdir(tiny_model_dir):
        (model_dir / name).write_bytes(open(os.path.join(tiny_model_dir, name), "rb").read())
    models, benches = parse_models([str(model_dir)]), [load_benchmark("synthetic#n=2")]
    kwargs = dict(output_dir=str(tmp_path / "eval"), temperatures=[1.0], k=2, max_new_tokens=3, progress=False)
    evaluate(models, benches, **kwargs)
    evaluate(models, benches, **kwargs)   # the same model again: its cache is used
    build_model(build_tokenizer(), seed=1).save_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"made with different settings \(model_weights\)"):
        evaluate(models, benches, **kwargs)
    meta_path = tmp_path / "eval" / "samples" / "model" / "synthetic" / "cache_meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["model_weights"]   # as an erpo that did not record the weights left it: it cannot be checked
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"made by an erpo that did not record model_weights \(model_weights\)"):
        evaluate(models, benches, **kwargs)

def test_cache_refuses_samples_of_another_seeding(tmp_path, tiny_model_dir, monkeypatch):
    """The cache records what a seed draws with the engine (`RolloutEngine.seeding`): after an erpo update that
    changes it (vLLM's per-request seeds became hashes), a fresh run would not draw the cached samples, so they are
    refused; a cache from an erpo that did not record it is refused too, once, in the same line."""
    from erpo.rollout.hf import HFRollout
    models, benches = parse_models([tiny_model_dir]), [load_benchmark("synthetic#n=2")]
    kwargs = dict(output_dir=str(tmp_path), temperatures=[1.0], k=2, max_new_tokens=3, progress=False)
    evaluate(models, benches, **kwargs)
    meta_path = next(tmp_path.glob("samples/*/synthetic/cache_meta.json"))
    assert json.loads(meta_path.read_text())["seeding"] == HFRollout.seeding
    with monkeypatch.context() as patch:
        patch.setattr(HFRollout, "seeding", "hf-next")
        with pytest.raises(ValueError, match=r"made with different settings \(seeding\)"):
            evaluate(models, benches, **kwargs)
    meta = json.loads(meta_path.read_text())
    del meta["seeding"]   # as an erpo before the seeding was recorded left it
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"made by an erpo that did not record seeding \(seeding\); use another "
                                         r"--output-dir or delete that directory"):
        evaluate(models, benches, **kwargs)


def test_cache_refuses_samples_of_other_prompt_tokens(tmp_path, tiny_model_dir, monkeypatch):
    """Samples made from other prompt token ids (another tokenizer, chat template or prompt encoding: a bare
    prompt without the BOS of before) are not reused: the cache records the ids' hash."""
    import erpo.eval.sampling as sampling
    models, benches = parse_models([tiny_model_dir]), [load_benchmark("synthetic#n=2")]
    evaluate(models, benches, output_dir=str(tmp_path), temperatures=[1.0], k=2, max_new_tokens=3, progress=False)
    encode = sampling.encode_prompt
    monkeypatch.setattr(sampling, "encode_prompt", lambda *a, **kw: (encode(*a, **kw)[0], [0] + encode(*a, **kw)[1]))
    with pytest.raises(ValueError, match="prompt_ids_sha256"):
        evaluate(models, benches, output_dir=str(tmp_path), temperatures=[1.0], k=2, max_new_tokens=3,
                 progress=False)



def test_samples_graded_by_another_grader_are_graded_again(tmp_path, tiny_model_dir, monkeypatch):
    """A cached sample keeps the verdict of the grader that judged it (math-verify's version, or the fallback where
    it was missing; erpo's rules of then): one judged by another is graded again, not trusted, and written back."""
    tokenizer = build_tokenizer()
    engine = ScriptedEngine(tokenizer)
    monkeypatch.setattr(evaluation, "build_engine", lambda *a, **kw: (engine, tokenizer))
    models, benches = parse_models([f"m={tiny_model_dir}"]), load_benchmarks(["synthetic#n=6#seed=1"])
    kwargs = dict(temperatures=[1.0], k=4, output_dir=str(tmp_path), progress=False)
    first = evaluate(models, benches, **kwargs)["rows"]
    path = tmp_path / "samples" / "m" / "synthetic" / "temp-1.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["grader"] for r in records} == {rewards.grader_identity()}
    # As an older grader left them: every verdict the other way, no grader named.
    path.write_text("".join(json.dumps({**r, "correct": not r["correct"], "grader": None}) + "\n" for r in records))
    calls = engine.calls
    assert evaluate(models, benches, **kwargs)["rows"] == first and engine.calls == calls   # graded, not sampled
    lines = path.read_text().splitlines()
    assert len(lines) == 2 * len(records)   # the new verdicts appended (a sample's last line wins), once:
    assert evaluate(models, benches, **kwargs)["rows"] == first and len(path.read_text().splitlines()) == len(lines)
    latest = read_cache(str(path), 4)
    assert all(r["grader"] == rewards.grader_identity() for samples in latest.values() for r in samples)

def test_eval_validates_arguments(tmp_path, tiny_model_dir):
    models, benches = parse_models([tiny_model_dir]), [load_benchmark("synthetic#n=2")]
    for bad, match in [(dict(k=0), "k must"), (dict(temperatures=[0.0]), "temperatures"),
                       (dict(pass_ks=[8]), "pass_ks"), (dict(top_p=0.0), "top_p"), (dict(batch_size=0), "batch_size")]:
        kwargs = dict(temperatures=[1.0], k=2, output_dir=str(tmp_path), progress=False) | bad
        with pytest.raises(ValueError, match=match):
            evaluate(models, benches, **kwargs)


def test_cli_two_models_writes_tables_and_png(tmp_path, tiny_model_dir, capsys):
    run = _run_dir(tmp_path / "run", tiny_model_dir, max_new_tokens=4)
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--model", run + "@start", "--model", run,
                              "--benchmarks", f"synthetic#n=3,aime={FIXTURES}/aime24.parquet",
                              "--temperatures", "0.6,1.2", "--k", "2", "--output-dir", str(out),
                              "--max-new-tokens", "4", "--seed", "3", "--no-progress", "--device", "cpu"])
    run_eval(args)
    printed = capsys.readouterr().out
    markdown = (out / "results.md").read_text()
    table, paths = printed[:len(markdown)], printed[len(markdown):].split()
    assert table == markdown   # the results table on the terminal, then the files' paths
    assert sorted(os.path.basename(p) for p in paths) == [
        "accuracy_vs_temperature.png", "results.csv", "results.json", "results.md"]
    for text in ["**Mean Avg@2**", "**Mean Pass@2**", "**Mean Pass@1**", "| Model | synthetic | aime | Avg. |",
                 "| run@start |", "| run |", "temperatures <= 1.0 (0.6)", "temperatures 1.2-1.5 (1.2)",
                 "| Model | Metric | T=0.6 | T=1.2 | mean all | mean <=1.0 | mean 1.2-1.5 |"]:
        assert text in markdown, text
    data = json.loads((out / "results.json").read_text())
    assert {r["model"] for r in data["rows"]} == {"run@start", "run"}
    assert {r["benchmark"] for r in data["rows"]} == {"synthetic", "aime", BENCHMARK_AVERAGE}
    with open(out / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == len(data["rows"])
    assert {"model", "benchmark", "temperature", "avg@2", "pass@1", "pass@2", "mean_response_tokens"} <= set(table[0])
    # the one budget of the comparison (--max-new-tokens 4) was used
    assert all(float(r["mean_response_tokens"]) <= 4 for r in table)
    assert (out / "accuracy_vs_temperature.png").stat().st_size > 10_000


def test_cli_bad_arguments_exit_with_a_message(tmp_path, tiny_model_dir):
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    cases = [
        (["--model", str(tmp_path / "nope")], "no such local directory"),
        (["--model", tiny_model_dir, "--benchmarks", "x.csv"], "is not a file"),
        (["--model", tiny_model_dir, "--temperatures", "0.5,hot"], "--temperatures"),
        (["--model", tiny_model_dir, "--pass-k", "1.5"], "--pass-k"),
        (["--model", tiny_model_dir, "--k", "4", "--pass-k", "8"], "--pass-k must lie in [1, --k=4]"),
    ]
    for argv, message in cases:
        with pytest.raises(UserError, match=re.escape(message)):
            run_eval(parser.parse_args(argv + ["--output-dir", str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists()  # nothing was generated or written


def test_backend_is_the_deprecated_spelling_of_engine(tmp_path, capsys):
    """`--engine` names the rollout engine as the trainer's `rollout.engine` does; `--backend` still works, with
    one deprecation line on stderr."""
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    assert parser.parse_args(["--model", "m"]).engine == "auto"
    assert parser.parse_args(["--model", "m", "--engine", "hf"]).engine == "hf"
    args = parser.parse_args(["--model", str(tmp_path / "nope"), "--backend", "hf"])
    with pytest.raises(UserError, match="no such local directory"):
        run_eval(args)
    assert args.engine == "hf"
    assert capsys.readouterr().err == "erpo eval: --backend is deprecated, use --engine (same values)\n"
