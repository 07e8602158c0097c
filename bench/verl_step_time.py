"""Seconds per `train_batch` step of verl's actor engine with erpo's loss against verl's own `ppo_loss`, side by side.

    python -m bench.verl_step_time [--steps 8] [--repeats 3] [--threads 2]

One verl `FSDPEngineWithLMHead` (FSDP2, gloo, world size 1, fp32, on the CPU platform of bench/verl_engine.py)
around a tiny Qwen2 (erpo.tiny: hidden 64, 2 layers), use_remove_padding on, 16 samples of prompt ~10 tokens +
response 32 tokens, micro-batches of 4, verl's default actor loss settings (token-mean, clip 0.2, dual clip 3,
no KL loss, no entropy). Per run and loss: `steps` calls of verl's `engine.train_batch` (zero_grad, forward and
backward over the 4 micro-batches, optimizer step), the first dropped as warm-up, median of the rest. The two
losses alternate run by run (`repeats` runs each) on the same engine and batch; ERPO is the paper's setting
(qkl_coef=0.01, static w(q) from a cache built once before timing). Reported: each loss's median s/step over its
runs with the min-max of its runs, and the ratio of medians.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="train_batch calls per run (the first is dropped)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per loss, alternating")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from bench import verl_engine
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    from erpo.integrations.verl import ERPOSettings, erpo_loss_fn, load_or_build_reference
    from erpo.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model_dir = tempfile.mkdtemp()
    build_model(tokenizer, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
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
    reference = load_or_build_reference(model_dir, tokenizer, prompts, path=f"{model_dir}/erpo_cache.json",
                                         temperature=1.0)
    losses = {"verl ppo_loss": partial(ppo_loss, config=config),
              "erpo_ppo_loss": erpo_loss_fn(config, ERPOSettings(qkl_coef=0.01), reference)}
    runs = {name: [] for name in losses}
    with engine.train_mode():
        for repeat in range(args.repeats):
            for name, loss_fn in losses.items():
                times = []
                for _ in range(args.steps):
                    start = time.perf_counter()
                    engine.train_batch(data.clone(), loss_fn)
                    times.append(time.perf_counter() - start)
                runs[name].append(statistics.median(times[1:]))
                print(f"run {repeat + 1} {name}: {runs[name][-1]:.4f} s/step", flush=True)
    print(f"\nverl {__import__('verl').__version__}, torch {torch.__version__}, {args.threads} threads, "
          f"{args.steps} steps x {args.repeats} runs per loss")
    print("| loss | median s/step | min-max over runs |\n|---|---|---|")
    for name, values in runs.items():
        print(f"| {name} | {statistics.median(values):.4f} | {min(values):.4f}-{max(values):.4f} |")
    ratio = statistics.median(runs["erpo_ppo_loss"]) / statistics.median(runs["verl ppo_loss"])
    print(f"ratio erpo / verl (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
