"""Sampling and grading for `erpo eval`: the rollout engine of one model, and k graded answers per problem of
a benchmark at one temperature, cached as they are made (erpo.eval.sample_cache)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from collections.abc import Mapping

import torch

from erpo.errors import UserError, setting_name, setting_value
from erpo.eval.model_specs import PromptSettings
from erpo.eval.problem_sets import Benchmark, problem_as_asked
from erpo.eval.sample_cache import append_lines, cache_path, chunk_seed, read_cache
from erpo.models.loading import load_causal_lm, load_tokenizer
from erpo.models.lora import MERGED_DIR, is_adapter_dir
from erpo.progress import progress as progress_display
from erpo.rollout import make_rollout_engine
from erpo.tasks.data import encode_prompt
from erpo.tasks.rewards import grade, grader_identity

log = logging.getLogger("erpo")


def build_engine(model_path: str, *, engine: str, device: str, dtype: str, seed: int, batch_size: int,
                 gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
                 names: Mapping[str, str] | None = None):
    """(RolloutEngine, tokenizer) for one model: vLLM when installed (engine auto/vllm), else HF generate.

    batch_size: prompts per HF generate call. gpu_memory_utilization: vLLM's share of each GPU.
    tensor_parallel_size: GPUs vLLM shards the model over (its own worker processes; vLLM only).
    names: how the caller's user spells these keywords (`erpo eval`: {"engine": "--engine", ...}), which the errors
    (a UserError, also a ValueError) use; a keyword absent names itself (`erpo.errors.setting_name`).
    """
    if engine not in ("auto", "hf", "vllm"):
        raise UserError(f"{setting_name(names, 'engine')} must be auto, hf or vllm, got {engine!r}")
    adapter = is_adapter_dir(model_path)
    if adapter and engine == "vllm":
        raise UserError(f"{setting_value(names, 'model_path', model_path)} is a LoRA adapter, which "
                        f"{setting_value(names, 'engine', 'vllm')} does not load: pass the merged model "
                        f"({MERGED_DIR}/ of a run trained with model.lora.export_merged=true) or "
                        f"{setting_value(names, 'engine', 'hf')}")
    use_vllm = engine == "vllm" or (engine == "auto" and not adapter and importlib.util.find_spec("vllm") is not None)
    if tensor_parallel_size > 1 and not use_vllm:
        raise UserError(f"{setting_value(names, 'tensor_parallel_size', tensor_parallel_size)} needs the vLLM engine "
                        f"({setting_value(names, 'engine', 'vllm')}, pip install 'erpo[vllm]')")
    tokenizer = load_tokenizer(model_path)  # exactly as the trainer loads it
    if use_vllm:
        vllm = make_rollout_engine("vllm", model_path=model_path, dtype=dtype, seed=seed,
                                   gpu_memory_utilization=gpu_memory_utilization,
                                   tensor_parallel_size=tensor_parallel_size, colocated=False, names=names)
        return vllm, tokenizer
    model = load_causal_lm(model_path, dtype="auto" if dtype == "auto" else getattr(torch, dtype), device=device)
    return make_rollout_engine("hf", model_path=model_path, model=model, tokenizer=tokenizer,
                               batch_size=batch_size), tokenizer


def grade_alternatives(completion: str, answers: list[str]) -> tuple[str | None, bool]:
    """`erpo.tasks.rewards.grade` against gold alternatives: (extracted answer, whether it matches any of them)."""
    pred, correct = None, False
    for gold in answers:
        pred, correct = grade(completion, gold)
        if correct:
            break
    return pred, correct


def problem_prompt_ids(tokenizer, problems: list[dict], settings: PromptSettings) -> list[list[int]]:
    """The token ids the model is given for each problem [P] (`encode_prompt` with the model's prompt settings)."""
    return [encode_prompt(tokenizer, problem_as_asked(p, settings.template), settings.template,
                          settings.use_chat_template)[1] for p in problems]


def prompt_ids_fingerprint(tokenizer, bench: Benchmark, settings: PromptSettings) -> str:
    """sha256 (16 hex) of every problem's prompt token ids: a sample cache made from other tokens (another tokenizer,
    chat template or prompt encoding) is refused, not reused."""
    ids = problem_prompt_ids(tokenizer, bench.problems, settings)
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def regrade_cached(path: str, done: dict[int, list[dict]], bench: Benchmark, grader: str) -> None:
    """Grade again, in place in `done` ({problem id: its cached sample records}), every cached sample that another
    grader judged (`erpo.tasks.rewards.grader_identity`: math-verify's version, or the fallback where it was missing,
    and erpo's rules), and append the new verdicts to the cache file at `path` (a sample's last line wins)."""
    answers = {p["id"]: p["answers"] for p in bench.problems}
    stale = [r for pid, samples in done.items() if pid in answers for r in samples if r.get("grader") != grader]
    if not stale:
        return
    log.info("sample cache %s: grading %d samples again (graded by another grader than %s)", path, len(stale), grader)
    regraded = []
    for record in stale:
        pred, correct = grade_alternatives(record["completion"], answers[record["id"]])
        regraded.append({**record, "pred": pred, "correct": correct, "grader": grader})
    append_lines(path, regraded)
    for record in regraded:
        done[record["id"]][record["sample"]] = record


def sample_benchmark(engine, tokenizer, bench: Benchmark, *, model_label: str, temperature: float, k: int,
                     top_p: float, settings: PromptSettings, batch_size: int, seed: int, output_dir: str,
                     progress: bool = True) -> list[list[dict]]:
    """Sample k completions per problem at one temperature, caching them as they are made.

    Returns one list of k sample records (``id, sample, completion, pred, correct, grader, num_tokens,
    truncated``) per problem, in benchmark order; problems already in the cache are not sampled again (their samples
    are graded again where another grader judged them: `regrade_cached`).
    """
    path = cache_path(output_dir, model_label, bench.name, temperature)
    done = read_cache(path, k)
    grader = grader_identity()
    regrade_cached(path, done, bench, grader)
    todo = [p for p in bench.problems if p["id"] not in done]
    bar = progress_display(len(bench.problems), f"{model_label} | {bench.name} | T={temperature:g}", "problem",
                           initial=len(bench.problems) - len(todo), enabled=progress)
    for start in range(0, len(bench.problems), batch_size):
        chunk = bench.problems[start:start + batch_size]
        if all(p["id"] in done for p in chunk):
            continue
        prompt_ids = problem_prompt_ids(tokenizer, chunk, settings)
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
                            "correct": correct, "grader": grader, "num_tokens": len(batch.response_ids[row]),
                            "truncated": bool(batch.truncated[row])})
        if any(count != k for count in next_sample):
            raise RuntimeError(f"rollout engine returned {next_sample} samples per prompt, expected {k}")
        append_lines(path, records)
        for record in records:
            done.setdefault(record["id"], [None] * k)[record["sample"]] = record
        bar.update(len({r["id"] for r in records}))
    bar.close()
    return [done[p["id"]] for p in bench.problems]
