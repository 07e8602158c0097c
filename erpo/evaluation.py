"""`erpo eval`: multi-temperature, multi-metric evaluation of one or more models (the paper's section 5).

For every model x benchmark x temperature, k answers are sampled per problem, graded with the trainer's
verifier (``erpo.rewards``) and scored with ``erpo.metrics`` (Avg@k, Pass@k, Pass@1). Scores are then
averaged over benchmarks ("Avg.") and over temperature ranges (all, <= 1.0, 1.2-1.5) and written to
``OUTPUT_DIR/results.{md,json,csv}`` in the paper's Table 2 layout plus ``accuracy_vs_temperature.png``.

Samples are cached in ``OUTPUT_DIR/samples/MODEL/BENCHMARK/temp-T.jsonl``, appended one chunk of
problems at a time, so an interrupted evaluation resumes where it stopped. Each chunk is sampled with
its own seed derived from (seed, benchmark, temperature, chunk start), so the resumed result equals an
uninterrupted one on the same hardware.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import fcntl
import gc
import hashlib
import importlib.util
import json
import os
import zlib

from tqdm.auto import tqdm

from erpo.atomic import publish
from erpo.data import encode_prompt
from erpo.metrics import default_pass_ks, summarize_correctness
from erpo.problem_sets import Benchmark, load_benchmarks
from erpo.records import iter_jsonl
from erpo.rewards import grade

# Named temperature grids for --temperatures. "paper": the grid the paper's range means are formed over (its
# Table 2: every "<= 1.0" mean is a mean of 10 temperatures 0.1..1.0 and most "1.2-1.5" means one of 1.2..1.5;
# docs/evaluation.md). "quick": five points of it, the columns the paper prints.
TEMPERATURE_GRIDS = {
    "paper": (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.3, 1.4, 1.5),
    "quick": (0.1, 0.6, 1.0, 1.2, 1.5),
}
DEFAULT_TEMPERATURES = "paper"
DEFAULT_K = 32
DEFAULT_MAX_NEW_TOKENS = 3000  # one budget for every model of a comparison: Dr.GRPO's evaluation budget
# Prompt templates that are whole prompts (no chat template around them), by name. "qwen-math": Dr.GRPO's
# evaluation prompt for base models (its apply_qwen_math_template), which the paper's base-model numbers follow.
RAW_TEMPLATES = {
    "qwen-math": ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
                  "<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"),
}
ALL_TEMPERATURES = "all"
# Temperature ranges of the paper's tables: label -> membership test.
TEMPERATURE_RANGES = {
    ALL_TEMPERATURES: lambda t: True,
    "<=1.0": lambda t: t <= 1.0 + 1e-9,
    "1.2-1.5": lambda t: 1.2 - 1e-9 <= t <= 1.5 + 1e-9,
}
# Their titles in results.md.
RANGE_NAMES = {ALL_TEMPERATURES: "all temperatures", "<=1.0": "temperatures <= 1.0",
               "1.2-1.5": "temperatures 1.2-1.5"}
BENCHMARK_AVERAGE = "Avg."


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ModelSpec:
    """A model to evaluate: table label, path or Hub name to load, and the run dir it came from."""

    label: str
    path: str
    run_dir: str | None = None


RUN_START_SUFFIX = "@start"


def _is_hf_model_dir(path: str) -> bool:
    """A Hugging Face model (config.json) or a LoRA adapter on one (adapter_config.json, `erpo.lora`)."""
    from erpo.lora import is_adapter_dir

    return os.path.isfile(os.path.join(path, "config.json")) or is_adapter_dir(path)


def _is_run_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.yaml"))


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "meta.json"))


def resolve_checkpoint(target: str, label: str) -> ModelSpec:
    """A training checkpoint (``RUN_DIR/checkpoints/step-N``): its Hugging Face export ``hf/``, with the run's
    prompt settings; labelled ``RUN@step-N`` unless ``label`` is given."""
    from erpo.checkpoint import HF_DIR
    from erpo.checkpoint_manifest import require_intact

    model = os.path.join(target, HF_DIR)
    require_intact(target, only=f"{HF_DIR}/")   # its manifest: sizes and digests of hf/'s files
    if not _is_hf_model_dir(model):
        raise ValueError(f"--model {target}: this checkpoint holds no Hugging Face export ({HF_DIR}/config.json): "
                         "it was saved with trainer.save_hf=false or by an older erpo; evaluate a checkpoint saved "
                         "with trainer.save_hf=true, or the run's final/ model")
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(target)))
    run_dir = run_dir if _is_run_dir(run_dir) else None
    step = os.path.basename(os.path.abspath(target))
    name = label or (f"{os.path.basename(run_dir)}@{step}" if run_dir else step)
    return ModelSpec(name, model, run_dir)


def load_run_config(run_dir: str):
    """The resolved ``erpo.config.Config`` a training run was started with (``RUN_DIR/config.yaml``)."""
    from erpo.config import load_config

    return load_config(os.path.join(run_dir, "config.yaml"))


def run_start_model(run_dir: str) -> str:
    """Path or Hub name of the pre-RL model a run started from (for the tiny default: its SFT warm start)."""
    from erpo.models import model_path_for

    return model_path_for(load_run_config(run_dir))


def resolve_model(spec: str) -> ModelSpec:
    """Resolve ``[LABEL=]TARGET``. TARGET is an HF model dir, a Hub name, a training output dir (its
    ``final/`` model), a checkpoint dir of one (``RUN_DIR/checkpoints/step-N``, its ``hf/`` model) or
    ``RUN_DIR@start`` (the model that run started from, before RL)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--model must be a non-empty path or name, got {spec!r}")
    label, eq, target = spec.strip().partition("=")
    if not eq:
        label, target = "", label
    target = target.rstrip("/") or target
    if target.endswith(RUN_START_SUFFIX):
        run_dir = target[: -len(RUN_START_SUFFIX)].rstrip("/")
        if not _is_run_dir(run_dir):
            raise ValueError(f"--model {target}: {run_dir} is not a training output dir (no config.yaml)")
        name = label or os.path.basename(os.path.abspath(run_dir)) + RUN_START_SUFFIX
        return ModelSpec(name, run_start_model(run_dir), run_dir)
    if os.path.isdir(target):
        name = label or os.path.basename(os.path.abspath(target))
        final = os.path.join(target, "final")
        if _is_hf_model_dir(final):
            return ModelSpec(name, final, target if _is_run_dir(target) else None)
        if _is_hf_model_dir(target):
            return ModelSpec(name, target, None)
        if _is_checkpoint_dir(target):
            return resolve_checkpoint(target, label)
        raise ValueError(
            f"--model {target}: neither an HF model dir (config.json), a finished training run "
            f"(final/config.json) nor a checkpoint (meta.json); for an unfinished run pass one of its "
            f"checkpoints (RUN_DIR/checkpoints/step-N)"
        )
    from erpo.model_source import resolve_model_source

    return ModelSpec(label or target.replace("/", "--"), resolve_model_source(target, "--model"), None)


def parse_models(values: list[str]) -> list[ModelSpec]:
    """``--model`` values (repeatable, each comma-separated) -> unique ModelSpecs."""
    specs = [resolve_model(item) for value in values for item in value.split(",") if item.strip()]
    if not specs:
        raise ValueError("--model: give at least one model")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--model labels must be unique, got {labels}; name them LABEL=PATH")
    return specs


@dataclasses.dataclass
class PromptSettings:
    """How prompts are rendered and how long answers may be; a run's own settings by default."""

    template: str = "paper"
    use_chat_template: bool = True
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS


def prompt_settings(model: ModelSpec, template: str | None, max_new_tokens: int) -> PromptSettings:
    """Settings for one model: `template` (a name of RAW_TEMPLATES, "paper", "plain" or a format string), else
    its training run's prompt format, else the paper's; `max_new_tokens` is the comparison's single budget."""
    settings = PromptSettings(max_new_tokens=max_new_tokens)
    if model.run_dir is not None:
        cfg = load_run_config(model.run_dir)
        settings.template, settings.use_chat_template = cfg.data.template, cfg.data.use_chat_template
    if template in RAW_TEMPLATES:
        settings.template, settings.use_chat_template = RAW_TEMPLATES[template], False
    elif template is not None:
        settings.template = template
    return settings


def parse_templates(values: list[str] | None, labels: list[str]) -> dict[str, str]:
    """``--template`` values -> {model label: template}. ``LABEL=TEMPLATE`` sets one model's template (LABEL one
    of `labels`), a value without a known label prefix sets the template of every model not named."""
    per_model, every = {}, None
    for value in values or []:
        label, eq, template = value.partition("=")
        if eq and label in labels:
            per_model[label] = template
        elif every is None:
            every = value
        else:
            raise ValueError(f"--template: two templates for every model ({every!r}, {value!r}); prefix one with "
                             f"a model label ({', '.join(labels)}) as LABEL=TEMPLATE")
    return {label: per_model.get(label, every) for label in labels if per_model.get(label, every) is not None}


# ----------------------------------------------------------------------------------------------------
# Sample cache
# ----------------------------------------------------------------------------------------------------
def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in name)


def cache_dir(output_dir: str, model: str, benchmark: str) -> str:
    """Directory holding the samples of one (model, benchmark) and the settings they were made with."""
    return os.path.join(output_dir, "samples", _safe(model), _safe(benchmark))


def cache_path(output_dir: str, model: str, benchmark: str, temperature: float) -> str:
    """JSONL file holding the samples of one (model, benchmark, temperature)."""
    return os.path.join(cache_dir(output_dir, model, benchmark), f"temp-{temperature:g}.jsonl")


def read_cache(path: str, k: int) -> dict[int, list[dict]]:
    """Problems whose k samples are all in the cache: ``{problem id: [sample 0..k-1 records]}``.

    A torn last line (crash while writing) is ignored; for a repeated (id, sample) the last line wins.
    """
    if not os.path.isfile(path):
        return {}
    samples: dict[int, dict[int, dict]] = {}
    for _, record in iter_jsonl(path, torn_tail_ok=True):
        samples.setdefault(int(record["id"]), {})[int(record["sample"])] = record
    return {pid: [by_index[j] for j in range(k)] for pid, by_index in samples.items()
            if all(j in by_index for j in range(k))}


def _append_lines(path: str, records: list[dict]) -> None:
    """Append records as JSON lines and fsync; a torn last line left by a crash is cut off first (the file is
    read whole only then: each chunk's append costs its own size, not the cache's)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "ab+") as handle:
        # An append-only log cannot be published whole without rewriting it: evaluations sharing an output dir
        # take turns instead, so none cuts off as torn the lines another is still writing.
        fcntl.flock(handle, fcntl.LOCK_EX)
        size = handle.seek(0, os.SEEK_END)
        if size:
            handle.seek(size - 1)
            if handle.read(1) != b"\n":  # torn: only then is the whole file read, to find its last newline
                handle.seek(0)
                handle.truncate(handle.read().rfind(b"\n") + 1)
        handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def _check_cache_meta(directory: str, meta: dict) -> None:
    """Write the sampling settings next to the cache, or refuse to mix samples made with others. Of evaluations
    starting at once, the first to publish its settings sets them for all (`erpo.atomic.publish`)."""
    path = os.path.join(directory, "cache_meta.json")
    if not os.path.isfile(path):
        publish(path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8"),
                keep=os.path.isfile)
    with open(path, encoding="utf-8") as handle:
        old = json.load(handle)
    changed = sorted(key for key in set(old) | set(meta) if old.get(key) != meta.get(key))
    if changed:
        raise ValueError(
            f"sample cache {directory} was made with different settings ({', '.join(changed)}); "
            "use another --output-dir or delete that directory"
        )


def _problems_fingerprint(bench: Benchmark) -> str:
    text = json.dumps([[p["id"], p["problem"], p["answers"]] for p in bench.problems], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def chunk_seed(seed: int, benchmark: str, temperature: float, start: int) -> int:
    """Sampling seed of the chunk of problems starting at ``start`` (stable across runs and resumes)."""
    return (seed * 1_000_003 + zlib.crc32(f"{benchmark}|{temperature:g}|{start}".encode())) % (2**31 - 1)


# ----------------------------------------------------------------------------------------------------
# Generation and grading
# ----------------------------------------------------------------------------------------------------
def build_engine(model_path: str, *, backend: str, device: str, dtype: str, seed: int, batch_size: int,
                 gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1):
    """(RolloutEngine, tokenizer) for one model: vLLM when installed (backend auto/vllm), else HF generate.

    batch_size: prompts per HF generate call. gpu_memory_utilization: vLLM's share of each GPU.
    tensor_parallel_size: GPUs vLLM shards the model over (its own worker processes; vLLM only).
    """
    import torch

    from erpo.lora import MERGED_DIR, is_adapter_dir
    from erpo.models import load_causal_lm, load_tokenizer, make_rollout_engine

    if backend not in ("auto", "hf", "vllm"):
        raise ValueError(f"--backend must be auto, hf or vllm, got {backend!r}")
    adapter = is_adapter_dir(model_path)
    if adapter and backend == "vllm":
        raise ValueError(f"--model {model_path} is a LoRA adapter, which --backend vllm does not load: pass the merged "
                         f"model ({MERGED_DIR}/ of a run trained with model.lora.export_merged=true) or --backend hf")
    use_vllm = backend == "vllm" or (backend == "auto" and not adapter and importlib.util.find_spec("vllm") is not None)
    if tensor_parallel_size > 1 and not use_vllm:
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} needs the vLLM backend (--backend vllm, "
                         "pip install 'erpo[vllm]')")
    tokenizer = load_tokenizer(model_path)  # exactly as the trainer loads it
    if use_vllm:
        engine = make_rollout_engine("vllm", model_path=model_path, dtype=dtype, seed=seed,
                                     gpu_memory_utilization=gpu_memory_utilization,
                                     tensor_parallel_size=tensor_parallel_size, colocated=False)
        return engine, tokenizer
    model = load_causal_lm(model_path, dtype="auto" if dtype == "auto" else getattr(torch, dtype), device=device)
    return make_rollout_engine("hf", model_path=model_path, model=model, tokenizer=tokenizer,
                               batch_size=batch_size), tokenizer


def grade_alternatives(completion: str, answers: list[str]) -> tuple[str | None, bool]:
    """`erpo.rewards.grade` against gold alternatives: (extracted answer, whether it matches any of them)."""
    pred, correct = None, False
    for gold in answers:
        pred, correct = grade(completion, gold)
        if correct:
            break
    return pred, correct


def sample_benchmark(engine, tokenizer, bench: Benchmark, *, model_label: str, temperature: float, k: int,
                     top_p: float, settings: PromptSettings, batch_size: int, seed: int, output_dir: str,
                     progress: bool = True) -> list[list[dict]]:
    """Sample k completions per problem at one temperature, caching them as they are made.

    Returns one list of k sample records (``id, sample, completion, pred, correct, num_tokens,
    truncated``) per problem, in benchmark order; problems already in the cache are not sampled again.
    """
    path = cache_path(output_dir, model_label, bench.name, temperature)
    done = read_cache(path, k)
    todo = [p for p in bench.problems if p["id"] not in done]
    bar = tqdm(total=len(bench.problems), initial=len(bench.problems) - len(todo), disable=not progress,
               desc=f"{model_label} | {bench.name} | T={temperature:g}", unit="problem")
    for start in range(0, len(bench.problems), batch_size):
        chunk = bench.problems[start:start + batch_size]
        if all(p["id"] in done for p in chunk):
            continue
        prompt_ids = [encode_prompt(tokenizer, p["problem"], settings.template, settings.use_chat_template)[1]
                      for p in chunk]
        batch = engine.generate(prompt_ids, n=k, temperature=temperature, top_p=top_p,
                                max_new_tokens=settings.max_new_tokens,
                                seed=chunk_seed(seed, bench.name, temperature, start))
        next_sample = [0] * len(chunk)
        records = []
        for row, prompt_row in enumerate(batch.prompt_index):
            problem = chunk[prompt_row]
            j = next_sample[prompt_row]
            next_sample[prompt_row] += 1
            if problem["id"] in done:
                continue
            text = tokenizer.decode(batch.response_ids[row], skip_special_tokens=True)
            pred, correct = grade_alternatives(text, problem["answers"])
            records.append({"id": problem["id"], "sample": j, "completion": text, "pred": pred,
                            "correct": correct, "num_tokens": len(batch.response_ids[row]),
                            "truncated": bool(batch.truncated[row])})
        if any(count != k for count in next_sample):
            raise RuntimeError(f"rollout engine returned {next_sample} samples per prompt, expected {k}")
        _append_lines(path, records)
        for record in records:
            done.setdefault(record["id"], [None] * k)[record["sample"]] = record
        bar.update(len({r["id"] for r in records}))
    bar.close()
    return [done[p["id"]] for p in bench.problems]


# ----------------------------------------------------------------------------------------------------
# Scores and tables
# ----------------------------------------------------------------------------------------------------
def score_samples(samples_by_problem: list[list[dict]], pass_ks: list[int]) -> dict:
    """Metrics of one (model, benchmark, temperature): summarize_correctness plus response statistics."""
    correct = [[bool(s["correct"]) for s in samples] for samples in samples_by_problem]
    scores = summarize_correctness(correct, pass_ks)
    flat = [s for samples in samples_by_problem for s in samples]
    scores["mean_response_tokens"] = sum(s["num_tokens"] for s in flat) / len(flat)
    scores["truncated_frac"] = sum(bool(s["truncated"]) for s in flat) / len(flat)
    return scores


def range_members(temperatures) -> dict[str, list[float]]:
    """TEMPERATURE_RANGES label -> the given temperatures inside that range, for each range holding any."""
    members = {label: [t for t in temperatures if inside(t)] for label, inside in TEMPERATURE_RANGES.items()}
    return {label: temps for label, temps in members.items() if temps}


def headline_metrics(k: int) -> list[tuple[str, str]]:
    """(row key, title) of the reported metrics: Avg@k, Pass@k, Pass@1 (Pass@k is Pass@1 when k == 1)."""
    return list(dict.fromkeys([(f"avg@{k}", f"Avg@{k}"), (f"pass@{k}", f"Pass@{k}"), ("pass@1", "Pass@1")]))


def _mean_rows(rows: list[dict], metric_keys: list[str]) -> dict:
    return {key: sum(r[key] for r in rows) / len(rows) for key in metric_keys}


def aggregate(per_temperature: list[dict], metric_keys: list[str]) -> list[dict]:
    """Add benchmark-average rows and temperature-range rows to per-temperature rows.

    per_temperature: rows ``{"model", "benchmark", "temperature": float, **metrics}``.
    Returns all rows; ``temperature`` is a float for single temperatures or a label of
    TEMPERATURE_RANGES; ``benchmark`` is BENCHMARK_AVERAGE for the unweighted mean over benchmarks.
    """
    rows = list(per_temperature)
    models = list(dict.fromkeys(r["model"] for r in rows))
    benches = list(dict.fromkeys(r["benchmark"] for r in rows))
    temps = sorted({r["temperature"] for r in rows})
    for model in models:
        for t in temps:
            group = [r for r in per_temperature if r["model"] == model and r["temperature"] == t]
            rows.append({"model": model, "benchmark": BENCHMARK_AVERAGE, "temperature": t,
                         **_mean_rows(group, metric_keys)})
    ranged = []
    for label, members in range_members(temps).items():
        for model in models:
            for bench in [*benches, BENCHMARK_AVERAGE]:
                group = [r for r in rows if r["model"] == model and r["benchmark"] == bench
                         and r["temperature"] in members]
                ranged.append({"model": model, "benchmark": bench, "temperature": label,
                               **_mean_rows(group, metric_keys)})
    return rows + ranged


def _table(header: list[str], body: list[list[float | str]], bold_best: bool) -> list[str]:
    """Markdown table; numbers with 3 decimals, the best of each numeric column in bold."""
    best = {}
    if bold_best:
        for col in range(1, len(header)):
            values = [row[col] for row in body if isinstance(row[col], float)]
            if values:
                best[col] = max(values)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + [":---:"] * (len(header) - 1)) + "|"]
    for row in body:
        cells = []
        for col, value in enumerate(row):
            if isinstance(value, float):
                text = f"{value:.3f}"
                cells.append(f"**{text}**" if col in best and value == best[col] else text)
            else:
                cells.append(str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(rows: list[dict], *, models: list[str], benchmarks: list[str], temperatures: list[float],
                    k: int, settings: dict) -> str:
    """The paper's Table 2 layout (one block per metric: models x benchmarks + Avg.) for each temperature
    range, then the per-temperature table (models x temperatures + range means) of the benchmark average."""
    metrics = headline_metrics(k)
    ranges = range_members(temperatures)
    index = {(r["model"], r["benchmark"], r["temperature"]): r for r in rows}
    bold = len(models) > 1
    out = ["# erpo eval results", ""]
    out += [f"- {key}: {value}" for key, value in settings.items()]
    out.append("")
    for label, members in ranges.items():
        out += [f"## Mean over {RANGE_NAMES[label]} ({', '.join(f'{t:g}' for t in members)})", ""]
        for key, title in metrics:
            out += [f"**Mean {title}**", ""]
            body = [[m, *[index[(m, b, label)][key] for b in [*benchmarks, BENCHMARK_AVERAGE]]] for m in models]
            out += _table(["Model", *benchmarks, BENCHMARK_AVERAGE], body, bold) + [""]
    out += [f"## By temperature ({BENCHMARK_AVERAGE} over benchmarks)", ""]
    header = ["Model", "Metric", *[f"T={t:g}" for t in temperatures], *[f"mean {r}" for r in ranges]]
    body = []
    for key, title in metrics:
        for m in models:
            body.append([m, title, *[index[(m, BENCHMARK_AVERAGE, t)][key] for t in temperatures],
                         *[index[(m, BENCHMARK_AVERAGE, r)][key] for r in ranges]])
    out += _table(header, body, bold_best=False) + [""]
    return "\n".join(out)


def write_results(output_dir: str, rows: list[dict], *, models: list[str], benchmarks: list[str],
                  temperatures: list[float], k: int, settings: dict) -> dict[str, str]:
    """Write results.md, results.json, results.csv and accuracy_vs_temperature.png; return their paths."""
    from erpo.plotting import plot_temperature_curves

    os.makedirs(output_dir, exist_ok=True)
    paths = {name: os.path.join(output_dir, f"results.{name}") for name in ("md", "json", "csv")}
    with open(paths["md"], "w", encoding="utf-8") as handle:
        handle.write(render_markdown(rows, models=models, benchmarks=benchmarks, temperatures=temperatures,
                                     k=k, settings=settings))
    with open(paths["json"], "w", encoding="utf-8") as handle:
        json.dump({"settings": settings, "rows": rows}, handle, indent=1)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(paths["csv"], "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    where = benchmarks[0] if len(benchmarks) == 1 else f"mean of {len(benchmarks)} benchmarks"
    average = {(r["model"], r["temperature"]): r for r in rows if r["benchmark"] == BENCHMARK_AVERAGE}
    curves = {f"{title} ({where})": {m: {t: average[(m, t)][key] for t in temperatures} for m in models}
              for key, title in headline_metrics(k)}
    paths["png"] = plot_temperature_curves(curves, os.path.join(output_dir, "accuracy_vs_temperature.png"))
    return paths


# ----------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------
def _numbers(text: str, name: str, kind: type) -> list:
    """Comma-separated values of `kind` (int or float) of the option `name`; ValueError naming it."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        what = "integers" if kind is int else "numbers"
        raise ValueError(f"{name} must be comma-separated {what}, got {text!r}") from err
    if not values:
        raise ValueError(f"{name} must hold at least one value")
    return values


def check_eval_arguments(*, k: int, temperatures: list[float], pass_ks: list[int] | None, batch_size: int,
                         top_p: float) -> tuple[list[float], list[int]]:
    """Validate sampling arguments (ValueError naming the bad one); return sorted unique temperatures and
    the Pass@k budgets (default: powers of two up to k; k itself is always included)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if not temperatures:
        raise ValueError("temperatures must hold at least one value")
    for t in temperatures:
        if not 0.0 < t <= 5.0:
            raise ValueError(f"temperatures must be in (0, 5], got {t}")
    pass_ks = sorted(set(pass_ks or default_pass_ks(k)) | {k})
    if pass_ks[0] < 1 or pass_ks[-1] > k:
        raise ValueError(f"pass_ks must lie in [1, k={k}], got {pass_ks}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return sorted(set(temperatures)), pass_ks


def evaluate(models: list[ModelSpec], benchmarks: list[Benchmark], *, temperatures: list[float], k: int,
             output_dir: str, pass_ks: list[int] | None = None, top_p: float = 1.0,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, batch_size: int = 8, seed: int = 0,
             templates: dict[str, str] | None = None, backend: str = "auto", device: str = "cpu",
             dtype: str = "auto", gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
             progress: bool = True) -> dict:
    """Evaluate every model on every benchmark at every temperature; write and return the results.

    Returns ``{"rows": [...], "paths": {"md", "json", "csv", "png"}}``. Rows hold per-temperature,
    benchmark-average and temperature-range scores (see ``aggregate``). Every model gets the same response
    budget `max_new_tokens`; `templates` maps model labels to their prompt templates (`parse_templates`).
    """
    import torch

    temperatures, pass_ks = check_eval_arguments(k=k, temperatures=temperatures, pass_ks=pass_ks,
                                                 batch_size=batch_size, top_p=top_p)
    metric_keys = None
    per_temperature = []
    model_lines = []
    for model in models:
        settings = prompt_settings(model, (templates or {}).get(model.label), max_new_tokens)
        engine, tokenizer = build_engine(model.path, backend=backend, device=device, dtype=dtype, seed=seed,
                                         batch_size=batch_size, gpu_memory_utilization=gpu_memory_utilization,
                                         tensor_parallel_size=tensor_parallel_size)
        model_lines.append(f"{model.label} = {model.path} (template {settings.template!r}, chat template "
                           f"{settings.use_chat_template}, max_new_tokens {settings.max_new_tokens}, "
                           f"{type(engine).__name__})")
        for bench in benchmarks:
            meta = {"model_path": os.path.abspath(model.path) if os.path.isdir(model.path) else model.path,
                    "benchmark_source": bench.source, "problems_sha256": _problems_fingerprint(bench),
                    "k": k, "top_p": top_p, "seed": seed, "batch_size": batch_size,
                    **dataclasses.asdict(settings)}
            _check_cache_meta(cache_dir(output_dir, model.label, bench.name), meta)
            for t in temperatures:
                samples = sample_benchmark(
                    engine, tokenizer, bench, model_label=model.label, temperature=t, k=k, top_p=top_p,
                    settings=settings, batch_size=batch_size, seed=seed, output_dir=output_dir,
                    progress=progress)
                scores = score_samples(samples, pass_ks)
                metric_keys = [key for key in scores if key not in ("num_problems", "n")]
                per_temperature.append({"model": model.label, "benchmark": bench.name, "temperature": t,
                                        **scores})
        del engine  # free this model before loading the next
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rows = aggregate(per_temperature, metric_keys)
    run_info = {
        "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "models": "; ".join(model_lines),
        "benchmarks": ", ".join(f"{b.name} ({len(b.problems)} problems)" for b in benchmarks),
        "samples per problem (k)": k, "temperatures": ", ".join(f"{t:g}" for t in temperatures),
        "max_new_tokens (every model)": max_new_tokens, "top_p": top_p, "seed": seed, "device": device,
        "Pass@1": "accuracy of the first sample of each problem",
    }
    paths = write_results(output_dir, rows, models=[m.label for m in models],
                          benchmarks=[b.name for b in benchmarks], temperatures=temperatures, k=k,
                          settings=run_info)
    return {"rows": rows, "paths": paths}


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``erpo eval`` options on a (sub)parser."""
    parser.add_argument("--model", action="append", required=True, metavar="[LABEL=]PATH_OR_RUN_DIR",
                        help="HF model dir, Hub name, training output dir (its final/ model), one of its "
                             "checkpoints (RUN_DIR/checkpoints/step-N) or RUN_DIR@start (the model the run started "
                             "from); repeatable or comma-separated to compare models")
    parser.add_argument("--benchmarks", default="synthetic",
                        help="comma-separated benchmark specs [NAME=]SOURCE[#problem=F#answer=F#split=S#limit=N]; "
                             "SOURCE: synthetic (default, offline), a .jsonl/.json/.parquet file, "
                             "math500/aime24/aime25/amc/minerva/olympiadbench or owner/name on the Hub")
    parser.add_argument("--temperatures", default=DEFAULT_TEMPERATURES,
                        help="comma-separated sampling temperatures, or a named grid: "
                             + "; ".join(f"{name} = {','.join(f'{t:g}' for t in grid)}"
                                         for name, grid in TEMPERATURE_GRIDS.items()) + " (default: %(default)s)")
    parser.add_argument("--k", type=int, default=DEFAULT_K, help="samples per problem (default: %(default)s)")
    parser.add_argument("--pass-k", default=None,
                        help="comma-separated k values for Pass@k (default: powers of two up to --k)")
    parser.add_argument("--output-dir", default="eval_results", help="results and sample cache (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help="response budget of every model of the comparison (default: %(default)s, Dr.GRPO's)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="base sampling seed (default: %(default)s)")
    parser.add_argument("--template", action="append", default=None, metavar="[LABEL=]TEMPLATE",
                        help="prompt template: paper, plain, qwen-math (Dr.GRPO's base-model prompt, no chat "
                             "template) or a string with {problem}; LABEL=TEMPLATE for one model (repeatable); "
                             "default: a run's own, else the paper's")
    parser.add_argument("--backend", choices=("auto", "hf", "vllm"), default="auto",
                        help="generation backend; auto = vLLM when installed, else HF generate")
    parser.add_argument("--device", default=None, help="torch device for HF generate (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="vLLM only: fraction of the GPU it may take (default: %(default)s)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="vLLM only: GPUs each model is sharded over, for models too large for one GPU "
                             "(default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run_eval(args: argparse.Namespace) -> None:
    """Entry point of ``erpo eval``: evaluate, write the results, print the markdown table and the files' paths.

    Bad arguments or inputs exit with ``erpo eval: <message>`` (status 1) instead of a traceback.
    """
    import torch

    try:
        models = parse_models(args.model)
        benchmarks = load_benchmarks([s for s in args.benchmarks.split(",") if s.strip()])
        pass_ks = _numbers(args.pass_k, "--pass-k", int) if args.pass_k else None
        temperatures = list(TEMPERATURE_GRIDS.get(args.temperatures, ())) or _numbers(args.temperatures,
                                                                                      "--temperatures", float)
        templates = parse_templates(args.template, [m.label for m in models])
        if args.max_new_tokens < 1 or args.tensor_parallel_size < 1:
            raise ValueError(f"--max-new-tokens and --tensor-parallel-size must be >= 1, got {args.max_new_tokens} "
                             f"and {args.tensor_parallel_size}")
        check_eval_arguments(k=args.k, temperatures=temperatures, pass_ks=pass_ks, batch_size=args.batch_size,
                             top_p=args.top_p)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise SystemExit(f"erpo eval: {exc}") from exc
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = evaluate(models, benchmarks, temperatures=temperatures, k=args.k,
                      output_dir=args.output_dir, pass_ks=pass_ks, top_p=args.top_p,
                      max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                      templates=templates, backend=args.backend, device=device, dtype=args.dtype,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      tensor_parallel_size=args.tensor_parallel_size, progress=not args.no_progress)
    with open(result["paths"]["md"], encoding="utf-8") as handle:
        print(handle.read())
    for path in result["paths"].values():
        print(path)
