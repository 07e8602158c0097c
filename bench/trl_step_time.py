"""Seconds per training step of erpo's ERPOTrainer against TRL's GRPOTrainer, side by side on one tiny setup.

    python -m bench.trl_step_time [--steps 6] [--repeats 2] [--threads 2] [--no-bias-correction]

Four configurations, interleaved `repeats` times, each a fresh tiny Qwen2 (erpo.models.tiny, same seed) on the same
arithmetic prompts: GRPO beta=0, ERPO beta=0, GRPO beta=0.04, ERPO beta=0.04 (ERPO: qkl_coef=0.01, static w(q),
fused_linear; TRL's defaults otherwise, so use_bias_correction_kl=True at beta=0.04 unless --no-bias-correction).
Every completion is 24 tokens long (min_new_tokens), so every step has the same shapes whatever the model learned.
A step is TRL's own `step_time` metric (generation, reward, old / reference log-probs when needed, loss, backward,
optimizer); the first step of each run is dropped as warm-up, the median of the others is the run's s/step,
and the median over runs is reported. The setup column is the trainer's construction, which for ERPO includes the
one-off ell_theta0(q) computation over the 28 prompts.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


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
    trainer.train()
    step_times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
    return {"trainer": trainer_name, "beta": beta, "setup_s": setup_s, "steps": len(step_times),
            "s_per_step": statistics.median(step_times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is dropped)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--no-bias-correction", action="store_true",
                        help="use_bias_correction_kl=False for both trainers (TRL's default is True; it changes the "
                             "KL's gradient, not the work)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from erpo.models.tiny import build_tokenizer, save_model_dir

    tokenizer = build_tokenizer()
    model_dir = save_model_dir(tempfile.mkdtemp(), tokenizer, seed=0)
    configs = [(name, beta) for beta in (0.0, 0.04) for name in ("GRPO", "ERPO")]
    runs = [one_run(name, beta, args.steps, model_dir, tokenizer, not args.no_bias_correction)
            for _ in range(args.repeats)
            for name, beta in configs]
    print("| trainer | beta | s/step (median over runs) | per run | setup s |")
    print("|---|---|---|---|---|")
    median = {}
    for name, beta in configs:
        mine = [r for r in runs if (r["trainer"], r["beta"]) == (name, beta)]
        median[name, beta] = statistics.median(r["s_per_step"] for r in mine)
        per_run = ", ".join(f"{r['s_per_step']:.3f}" for r in mine)
        print(f"| {name} | {beta} | {median[name, beta]:.3f} | {per_run} | "
              f"{statistics.median(r['setup_s'] for r in mine):.2f} |")
    print(f"ERPO/GRPO at beta=0: {median['ERPO', 0.0] / median['GRPO', 0.0]:.2f}; "
          f"at beta=0.04: {median['ERPO', 0.04] / median['GRPO', 0.04]:.2f}; "
          f"ERPO beta=0 / GRPO beta=0.04: {median['ERPO', 0.0] / median['GRPO', 0.04]:.2f}")


if __name__ == "__main__":
    main()
