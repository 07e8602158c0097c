"""Seconds per `train_batch` step of verl's actor engine with erpo's loss against verl's own `ppo_loss`, side by side.

    python -m bench.verl_step_time [--pairs 20] [--threads 1]

One verl `FSDPEngineWithLMHead` (FSDP2, gloo, world size 1, fp32, on the CPU platform of bench/verl_engine.py)
around a tiny Qwen2 (erpo.models.tiny: hidden 64, 2 layers), use_remove_padding on, 16 samples of prompt ~10 tokens +
response 32 tokens, micro-batches of 4, verl's default actor loss settings (token-mean, clip 0.2, dual clip 3,
no KL loss, no entropy). A step is one call of verl's `engine.train_batch` (zero_grad, forward and backward over
the 4 micro-batches, optimizer step) on the same engine and batch. The two losses alternate step by step in pairs
(the order flips every pair, the first pair is warm-up and dropped), so a load change on a shared machine hits
both alike; ERPO is the paper's setting (qkl_coef=0.01, static w(q) from a cache the engine scores once before
timing, as the `erpo` trainer mode does at start).
Reported: each loss's median s/step and min-max, and the median and quartiles of the per-pair ratio erpo / verl.
Then the loss alone: each loss function's forward and backward on one micro-batch's captured engine outputs
(its log-probs a leaf tensor), `pairs` x 10 interleaved calls, median milliseconds: what the loss adds to a step,
less exposed to a shared machine's noise than a whole step.
One torch thread by default, as bench.trl_step_time (its docstring has the measurement): on the shared 2-core
machine two threads turn a neighbour's load into bursts of steps 10 to 80 times slower, which the pairing spreads
over both losses but does not take out of their spread; the tiny model's operators are too small to split.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial

import torch

from bench import verl_engine  # before verl: it selects its CPU platform, which verl reads once, on import


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20, help="timed step pairs (one step of each loss)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: see the module docstring; the tables of 2026-11-23 used 2)")
    args = parser.parse_args()
    if args.pairs < 2:
        parser.error(f"--pairs {args.pairs}: at least 2 (the per-pair ratio's quartiles need two pairs)")
    torch.set_num_threads(args.threads)

    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    from erpo.integrations.query_reference import load_or_build_reference
    from erpo.integrations.verl import REBUILD, ERPOSettings, erpo_loss_fn
    from erpo.integrations.verl_reference import engine_precision, engine_query_logp
    from erpo.models.tiny import build_tokenizer, save_model_dir

    tokenizer = build_tokenizer()
    model_dir = save_model_dir(tempfile.mkdtemp(), tokenizer, seed=0)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = verl_engine.build_engine(model_dir, micro_batch_size=4, lr=1e-5)
    g = torch.Generator().manual_seed(0)
    prompts = [tokenizer(f"{a}*{b}+{a + b}=")["input_ids"] for a in range(10, 14) for b in range(20, 24)]
    responses = [torch.randint(3, len(tokenizer), (32,), generator=g).tolist() for _ in prompts]
    data = verl_engine.actor_batch(model, prompts, responses, pad_id=tokenizer.pad_token_id, tool_span=None,
                                   with_ref=False, with_is=False)
    data = verl_engine.set_engine_keys(engine, data, calculate_entropy=False)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=len(prompts),
                         ppo_micro_batch_size_per_gpu=4)
    score = partial(engine_query_logp, verl_engine.EngineWorkerGroup(engine), temperature=1.0, multiple=4,
                    tokens_per_call=len(prompts) * max(map(len, prompts)))   # 4: the engine's micro-batch size
    reference = load_or_build_reference(model_dir, tokenizer, prompts, path=f"{model_dir}/erpo_cache.json",
                                        temperature=1.0,
                                        precision=engine_precision(engine.model_config, torch.float32, "cpu"),
                                        score=score, trainer="verl", remedy=REBUILD)   # the engine's fp32
    losses = {"verl ppo_loss": partial(ppo_loss, config=config),
              "erpo_ppo_loss": erpo_loss_fn(config, ERPOSettings(qkl_coef=0.01), reference)}
    times = {name: [] for name in losses}
    with engine.train_mode():
        for pair in range(args.pairs + 1):
            order = list(losses) if pair % 2 == 0 else list(reversed(losses))
            for name in order:
                start = time.perf_counter()
                engine.train_batch(data.clone(), losses[name])
                if pair:                         # pair 0: warm-up
                    times[name].append(time.perf_counter() - start)
    ratios = sorted(ours / theirs for ours, theirs in zip(times["erpo_ppo_loss"], times["verl ppo_loss"]))
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"verl {__import__('verl').__version__}, torch {torch.__version__}, {args.threads} threads, "
          f"{args.pairs} timed pairs")
    print("| loss | median s/step | min-max |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.4f} | {min(values):.4f}-{max(values):.4f} |")
    print(f"per-pair ratio erpo / verl: median {statistics.median(ratios):.3f}, quartiles "
          f"{quartiles[0]:.3f}-{quartiles[2]:.3f}, min-max {ratios[0]:.3f}-{ratios[-1]:.3f}")
    loss_alone(engine, data, losses, 10 * args.pairs)


def loss_alone(engine, data, losses: dict, calls: int) -> None:
    """Median ms of each loss function's forward + backward on the first micro-batch's engine outputs."""
    captured = {}

    def capture(model_output, data, dp_group=None):
        captured.setdefault("inputs", ({k: v.detach() for k, v in model_output.items()}, data))
        return model_output["log_probs"].values().sum() * 0.0, {}

    engine.forward_backward_batch(data.clone(), capture, forward_only=True)
    model_output, micro_batch = captured["inputs"]
    times = {name: [] for name in losses}
    for call in range(calls + 1):
        for name in list(losses) if call % 2 == 0 else list(reversed(losses)):
            log_probs = model_output["log_probs"].clone().requires_grad_(True)
            start = time.perf_counter()
            loss, _ = losses[name](model_output={**model_output, "log_probs": log_probs}, data=micro_batch)
            loss.backward()
            if call:
                times[name].append(time.perf_counter() - start)
    print(f"loss alone, one micro-batch of {micro_batch.batch_size[0]} samples, {calls} calls each: " + ", ".join(
        f"{name} {1e3 * statistics.median(values):.2f} ms" for name, values in times.items()))

if __name__ == "__main__":
    main()
