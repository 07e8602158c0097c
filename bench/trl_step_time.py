"""Seconds per training step of erpo's ERPOTrainer against TRL's GRPOTrainer, side by side on one tiny setup.

    python -m bench.trl_step_time [--steps 6] [--repeats 2] [--threads 1] [--no-bias-correction]

Four configurations, interleaved `repeats` times, each a fresh tiny Qwen2 (erpo.models.tiny, same seed) on the same
arithmetic prompts: GRPO beta=0, ERPO beta=0, GRPO beta=0.04, ERPO beta=0.04 (ERPO: qkl_coef=0.01, static w(q),
fused_linear; TRL's defaults otherwise, so use_bias_correction_kl=True at beta=0.04 unless --no-bias-correction).
Every completion is 24 tokens long (min_new_tokens), so every step has the same shapes whatever the model learned.
A step is TRL's own `step_time` metric (generation, reward, old / reference log-probs when needed, loss, backward;
not the optimizer step); the first step of each run is dropped as warm-up, the median of the others is the run's
s/step, and the median over runs is reported. The setup column is the trainer's construction, which for ERPO
includes the one-off ell_theta0(q) computation over the 28 prompts.

On a shared CPU a run's median can be a burst of another process's load. With 2 torch threads on the 2 cores of
the development machine a busy neighbour made steps 10 to 80 times slower than quiet ones, in bursts covering half
of a run (libgomp's threads wait for each other at every operator, and one of them waits for a core), while with
one thread the same load made them 2 to 4 times slower, evenly; quiet, a step took about 0.04 s either way (the
tiny model's operators are too small to split), so one thread is the default. The fastest step over all runs
(every step does the same work, so the fastest is the least disturbed) moves less with the load than the median,
and the model forwards per step, counted by hooks (the policy's without gradient: generation's, one per token, and
old log-probs'; with gradient: the loss's; the reference model's), not at all. The load average is printed before
and after.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time

import torch

FORWARDS = ("no grad", "grad", "reference")   # the kinds of forward `count_forwards` counts, in the table's order


def count_forwards(trainer) -> collections.Counter:
    """A Counter of the trainer's model forwards from now on: of the policy, "no grad" (generation, one per token, and
    old log-probs) and "grad" (the loss's), by whether autograd records the call; "reference": of TRL's ref_model
    (beta != 0; none when the policy's adapters are disabled instead)."""
    forwards = collections.Counter()
    trainer.model.register_forward_pre_hook(
        lambda module, args: forwards.update(["grad" if torch.is_grad_enabled() else "no grad"]))
    if getattr(trainer, "ref_model", None) is not None:
        trainer.ref_model.register_forward_pre_hook(lambda module, args: forwards.update(["reference"]))
    return forwards


def one_run(trainer_name: str, beta: float, steps: int, model_dir: str, tokenizer, bias_correction: bool) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from erpo.integrations.trl import ERPOConfig, ERPOTrainer

    prompts = [[{"role": "user", "content": f"{a}+{b}="}] for a in range(2, 9) for b in range(3, 7)]

    def reward_digits(completions, **kwargs):
        return [float(sum(ch.isdigit() for ch in c[0]["content"])) for c in completions]

    settings = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=24, max_steps=steps, learning_rate=1e-3, beta=beta, report_to=[],
                    logging_steps=1, save_strategy="no", use_cpu=True, bf16=False, seed=0, disable_dropout=True,
                    use_bias_correction_kl=bias_correction, generation_kwargs={"min_new_tokens": 24})
    config, trainer_class = ((ERPOConfig(qkl_coef=0.01, query_weight="static", **settings), ERPOTrainer)
                             if trainer_name == "ERPO" else (GRPOConfig(**settings), GRPOTrainer))
    start = time.perf_counter()
    trainer = trainer_class(model=model_dir, reward_funcs=reward_digits, args=config,
                            train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                            processing_class=tokenizer)
    setup_s = time.perf_counter() - start
    forwards = count_forwards(trainer)   # after the construction: ERPO's cache build is setup
    trainer.train()
    step_times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
    return {"trainer": trainer_name, "beta": beta, "setup_s": setup_s, "steps": len(step_times),
            "s_per_step": statistics.median(step_times[1:]), "fastest_step": min(step_times[1:]),
            "forwards_per_step": {kind: count / len(step_times) for kind, count in forwards.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is dropped)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration, interleaved")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: see the module docstring; the tables of 2026-11-23 used 2)")
    parser.add_argument("--no-bias-correction", action="store_true",
                        help="use_bias_correction_kl=False for both trainers (TRL's default is True; it changes the "
                             "KL's gradient, not the work)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (the first step is dropped as warm-up)")
    torch.set_num_threads(args.threads)

    from erpo.models.tiny import build_tokenizer, save_model_dir

    tokenizer = build_tokenizer()
    model_dir = save_model_dir(tempfile.mkdtemp(), tokenizer, seed=0)
    configs = [(name, beta) for beta in (0.0, 0.04) for name in ("GRPO", "ERPO")]
    load_before = os.getloadavg()
    runs = [one_run(name, beta, args.steps, model_dir, tokenizer, not args.no_bias_correction)
            for _ in range(args.repeats)
            for name, beta in configs]
    print("| trainer | beta | s/step (median over runs) | per run | fastest step "
          "| forwards/step (no grad + grad + reference) | setup s |")
    print("|---|---|---|---|---|---|---|")
    median, fastest = {}, {}
    for name, beta in configs:
        mine = [r for r in runs if (r["trainer"], r["beta"]) == (name, beta)]
        median[name, beta] = statistics.median(r["s_per_step"] for r in mine)
        fastest[name, beta] = min(r["fastest_step"] for r in mine)
        per_run = ", ".join(f"{r['s_per_step']:.3f}" for r in mine)
        forwards = {kind: {r["forwards_per_step"].get(kind, 0.0) for r in mine} for kind in FORWARDS}
        counted = " + ".join(" / ".join(f"{count:g}" for count in sorted(forwards[kind])) for kind in FORWARDS)
        print(f"| {name} | {beta} | {median[name, beta]:.3f} | {per_run} | {fastest[name, beta]:.3f} | {counted} | "
              f"{statistics.median(r['setup_s'] for r in mine):.2f} |")
    for label, seconds in (("median", median), ("fastest step", fastest)):
        print(f"{label}: ERPO/GRPO at beta=0: {seconds['ERPO', 0.0] / seconds['GRPO', 0.0]:.2f}; "
              f"at beta=0.04: {seconds['ERPO', 0.04] / seconds['GRPO', 0.04]:.2f}; "
              f"ERPO beta=0 / GRPO beta=0.04: {seconds['ERPO', 0.0] / seconds['GRPO', 0.04]:.2f}")
    print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}; after: {:.2f} {:.2f} {:.2f}".format(
        *load_before, *os.getloadavg()))


if __name__ == "__main__":
    main()
