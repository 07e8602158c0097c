"""Multi-temperature, multi-metric evaluation of one or more models (the paper's section 5).

For every model x benchmark x temperature, k answers are sampled per problem, graded with the trainer's
verifier (``erpo.tasks.rewards``) and scored with ``erpo.eval.metrics`` (Avg@k, Pass@k, Pass@1). Scores are then
averaged over benchmarks ("Avg.") and over temperature ranges (all, <= 1.0, 1.2-1.5) and written to
``OUTPUT_DIR/results.{md,json,csv}`` in the paper's Table 2 layout plus ``accuracy_vs_temperature.png``; the models
of runs' histories (``--model RUN_DIR@all``) also to ``history.{md,csv}`` (step x temperature per run) and
``accuracy_over_steps.png``.

Samples are cached in ``OUTPUT_DIR/samples/MODEL/BENCHMARK/temp-T.jsonl``, appended one chunk of
problems at a time, so an interrupted evaluation resumes where it stopped. Each chunk is sampled with
its own seed derived from (seed, benchmark, temperature, chunk start), so the resumed result equals an
uninterrupted one on the same hardware.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
from collections.abc import Mapping

import torch

from erpo.config import check_gpu_memory_utilization
from erpo.errors import setting_name
from erpo.eval.defaults import DEFAULT_MAX_NEW_TOKENS
from erpo.eval.metrics import default_pass_ks
from erpo.eval.model_specs import ModelSpec, prompt_settings
from erpo.eval.problem_sets import Benchmark
from erpo.eval.sample_cache import cache_dir, check_cache_meta, problems_fingerprint
from erpo.eval.sampling import build_engine, prompt_ids_fingerprint, sample_benchmark
from erpo.eval.tables import aggregate, score_samples, write_history, write_results
from erpo.models.fingerprint import model_fingerprint


def check_eval_arguments(*, k: int, temperatures: list[float], pass_ks: list[int] | None, batch_size: int,
                         top_p: float, gpu_memory_utilization: float | None = None,
                         names: dict[str, str] | None = None) -> tuple[list[float], list[int]]:
    """Validate sampling arguments (ValueError naming the bad one, as the caller's user spelled it: `names` maps an
    argument to its name there, e.g. {"k": "--k"} for `erpo eval`; the keyword itself where absent); return sorted
    unique temperatures and the Pass@k budgets (default: powers of two up to k; k itself is always included).
    gpu_memory_utilization: vLLM's share of each GPU, checked before any engine is built (None: no vLLM to run)."""
    name = {key: setting_name(names, key)
            for key in ("k", "temperatures", "pass_ks", "batch_size", "top_p", "gpu_memory_utilization")}
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{name['k']} must be an integer >= 1 (samples per problem), got {k!r}")
    if not temperatures:
        raise ValueError(f"{name['temperatures']} must hold at least one temperature")
    for t in temperatures:
        if not 0.0 < t <= 5.0:
            raise ValueError(f"{name['temperatures']}: each temperature must be in (0, 5], got {t:g}")
    pass_ks = sorted(set(pass_ks or default_pass_ks(k)) | {k})
    if pass_ks[0] < 1 or pass_ks[-1] > k:
        raise ValueError(f"{name['pass_ks']} must lie in [1, {name['k']}={k}], got {pass_ks}")
    if batch_size < 1:
        raise ValueError(f"{name['batch_size']} must be an integer >= 1 (prompts per generate call), got {batch_size}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{name['top_p']} must be in (0, 1] (1: no nucleus cut), got {top_p:g}")
    if gpu_memory_utilization is not None:
        check_gpu_memory_utilization(gpu_memory_utilization, name["gpu_memory_utilization"])
    return sorted(set(temperatures)), pass_ks


def evaluate(models: list[ModelSpec], benchmarks: list[Benchmark], *, temperatures: list[float], k: int,
             output_dir: str, pass_ks: list[int] | None = None, top_p: float = 1.0,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, batch_size: int = 8, seed: int = 0,
             templates: dict[str, str] | None = None, engine: str = "auto", device: str = "cpu",
             dtype: str = "auto", gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
             progress: bool = True, names: Mapping[str, str] | None = None) -> dict:
    """Evaluate every model on every benchmark at every temperature; write and return the results.

    Returns ``{"rows": [...], "paths": {"md", "json", "csv", "png"}}`` (plus "history_md", "history_csv" and
    "history_png" when some models form a run's history). Rows hold per-temperature,
    benchmark-average and temperature-range scores (see ``aggregate``). Every model gets the same response
    budget `max_new_tokens`; `templates` maps model labels to their prompt templates (`parse_templates`).
    A bad setting is a ValueError naming it as `names` maps these keywords (`erpo eval`: its options, {"k": "--k",
    "model_path": "--model", ...}), else by the keyword.
    """

    temperatures, pass_ks = check_eval_arguments(k=k, temperatures=temperatures, pass_ks=pass_ks,
                                                 batch_size=batch_size, top_p=top_p,
                                                 gpu_memory_utilization=gpu_memory_utilization, names=names)
    metric_keys = None
    per_temperature = []
    model_lines = []
    for model in models:
        settings = prompt_settings(model, (templates or {}).get(model.label), max_new_tokens)
        rollout, tokenizer = build_engine(model.path, engine=engine, device=device, dtype=dtype, seed=seed,
                                         batch_size=batch_size, gpu_memory_utilization=gpu_memory_utilization,
                                         tensor_parallel_size=tensor_parallel_size, names=names)
        model_lines.append(f"{model.label} = {model.path} (template {settings.template!r}, chat template "
                           f"{settings.use_chat_template}, max_new_tokens {settings.max_new_tokens}, "
                           f"{type(rollout).__name__})")
        # The weights' content hash besides the path: a model saved again in place (a resumed run's final/) is
        # another model, whose samples the cache must not serve. Once per model: every benchmark's cache records it.
        identity = {"model_path": os.path.abspath(model.path) if os.path.isdir(model.path) else model.path,
                    "model_weights": model_fingerprint(model.path)}
        for bench in benchmarks:
            meta = {**identity, "benchmark_source": bench.source, "problems_sha256": problems_fingerprint(bench),
                    "prompt_ids_sha256": prompt_ids_fingerprint(tokenizer, bench, settings),
                    "k": k, "top_p": top_p, "seed": seed, "seeding": rollout.seeding,
                    "batch_size": batch_size, "dtype": dtype,
                    **dataclasses.asdict(settings)}
            check_cache_meta(cache_dir(output_dir, model.label, bench.name), meta)
            for t in temperatures:
                samples = sample_benchmark(
                    rollout, tokenizer, bench, model_label=model.label, temperature=t, k=k, top_p=top_p,
                    settings=settings, batch_size=batch_size, seed=seed, output_dir=output_dir,
                    progress=progress)
                scores = score_samples(samples, pass_ks)
                metric_keys = [key for key in scores if key not in ("num_problems", "n")]
                per_temperature.append({"model": model.label, "benchmark": bench.name, "temperature": t,
                                        **scores})
        del rollout  # free this model before loading the next
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rows = aggregate(per_temperature, metric_keys)
    run_info = {
        "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "models": "; ".join(model_lines),
        "benchmarks": ", ".join(f"{b.name} ({len(b.problems)} problems)" for b in benchmarks),
        "samples per problem (k)": k, "temperatures": ", ".join(f"{t:g}" for t in temperatures),
        "max_new_tokens (every model)": max_new_tokens, "top_p": top_p, "seed": seed, "device": device, "dtype": dtype,
        "Pass@1": "accuracy of the first sample of each problem",
    }
    paths = write_results(output_dir, rows, models=[m.label for m in models],
                          benchmarks=[b.name for b in benchmarks], temperatures=temperatures, k=k,
                          settings=run_info)
    paths.update(write_history(output_dir, rows, models=models, benchmarks=[b.name for b in benchmarks],
                               temperatures=temperatures, k=k))
    return {"rows": rows, "paths": paths}
