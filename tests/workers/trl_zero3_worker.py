"""ERPOTrainer's fused-linear path under DeepSpeed ZeRO-3 as a TRL user enables it (`deepspeed=` a ZeRO-3 config in
ERPOConfig), launched by tests/distributed/test_trl_zero3.py through torchrun with one CPU process: the launcher
variables DeepSpeed needs, DeepSpeed's CPU accelerator, gloo.

For a tiny Qwen2 with its lm_head tied to the input embedding and one untied, the same 3 optimizer steps (gradient
accumulation 2, the Query-KL against the cache and w(q), Adam, gradient clipping) of `ERPOTrainer(fused_linear=True)`
without DeepSpeed and under ZeRO-3, with every parameter partitioned (no persistence threshold, no reuse distance, no
prefetch): runs without DeepSpeed first, as accelerate's state is set anew for each trainer's arguments. The tied
model scores w(q) from the cache (query_weight="static"), the untied one from the current policy ("current": the query
rows scored again under no_grad). Written to --out, per head and run: every logged step's metrics, every parameter
after the steps (gathered one at a time under ZeRO-3), and under ZeRO-3 whether every parameter was partitioned and the
lm_head an empty shard again after training (nothing left holding it gathered); theta0's parameters; and what a model
name under ZeRO-3 gives (`born_partitioned`).
"""
import argparse
import copy

import datasets
import deepspeed
import torch
import transformers

from erpo.deepspeed_internals import skip_cpu_shm_op
from erpo.integrations.trl import ERPOConfig, ERPOTrainer
from erpo.models.tiny import build_tokenizer
from erpo_kernels.zero3 import find_lm_head, is_zero3_partitioned
from tiny_models import save_tiny_model, tiny_test_model
from torchrun import finish_worker
from trl_runs import PROMPTS, TRAINER_SETTINGS, reward_length

# ZeRO-3 that partitions every parameter and releases each as soon as its module is done: a head left gathered shows.
# "auto": HF's Trainer fills them from the arguments (batch sizes, accumulation, clipping), as for a user's config.
ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "train_batch_size": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                               "stage3_prefetch_bucket_size": 0}, "steps_per_print": 10**9}
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def theta0_of(tokenizer, tied: bool) -> torch.nn.Module:
    """The tests' tiny Qwen2 (seed 0), its lm_head tied to the input embedding or a copy of it (untied)."""
    model = tiny_test_model(tokenizer)
    if tied:
        return model
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        untied = transformers.Qwen2ForCausalLM(config)
    untied.load_state_dict(model.state_dict())
    untied.generation_config = copy.deepcopy(model.generation_config)
    with torch.no_grad():
        untied.lm_head.weight.copy_(model.lm_head.weight * 1.5)
    assert untied.lm_head.weight is not untied.get_input_embeddings().weight
    return untied


def whole_parameters(model: torch.nn.Module) -> dict:
    """Every parameter of `model` by name, whole (gathered one at a time under ZeRO-3)."""
    params = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=is_zero3_partitioned(param)):
            params[name] = param.detach().clone()
    return params


def train(tokenizer, tied: bool, zero3: bool, output_dir: str) -> dict:
    """Three optimizer steps of ERPOTrainer (module docstring); what the test compares."""
    model = theta0_of(tokenizer, tied)   # built before the arguments: not partitioned at birth
    args = ERPOConfig(**{**TRAINER_SETTINGS, "use_cpu": not zero3, "per_device_train_batch_size": 2},
                      output_dir=output_dir, deepspeed=ZERO3 if zero3 else None, fused_linear=True,
                      gradient_accumulation_steps=2, max_steps=3, learning_rate=3e-2, qkl_coef=0.5,
                      query_weight="static" if tied else "current")
    trainer = ERPOTrainer(model=model, reward_funcs=reward_length, args=args, processing_class=tokenizer,
                          train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    trainer.train()
    model = trainer.model
    logs = [{key: value for key, value in entry.items() if key not in TIMINGS}
            for entry in trainer.state.log_history if "loss" in entry]
    result = {"logs": logs, "params": whole_parameters(model),
              "tied": find_lm_head(model).weight is model.get_input_embeddings().weight}
    if zero3:
        result.update(partitioned=all(is_zero3_partitioned(p) for p in model.parameters()),
                      head_released=find_lm_head(model).weight.numel() == 0)
    return result


def born_partitioned(tokenizer, output_dir: str) -> dict:
    """A model name under ZeRO-3 (TRL loads it partitioned, zero.Init): the error ERPOTrainer gives with the Query-KL,
    and the steps it trains without the cache (qkl_coef=0, query_weight="current")."""
    path = save_tiny_model(f"{output_dir}/model", tokenizer)
    result = {}
    for qkl_coef, query_weight in ((0.5, "static"), (0.0, "current")):
        args = ERPOConfig(**{**TRAINER_SETTINGS, "use_cpu": False}, output_dir=output_dir, deepspeed=ZERO3,
                          max_steps=2, learning_rate=3e-2, qkl_coef=qkl_coef, query_weight=query_weight)
        try:
            trainer = ERPOTrainer(model=path, reward_funcs=reward_length, args=args, processing_class=tokenizer,
                                  train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]))
        except ValueError as error:
            result[query_weight] = str(error)
            continue
        trainer.train()
        result[query_weight] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    skip_cpu_shm_op()   # before accelerate creates DeepSpeed's comm layer: no shared-memory op built on the CPU
    tokenizer = build_tokenizer()
    runs = {(tied, zero3): train(tokenizer, tied, zero3, f"{args.out}.{tied}-{zero3}")
            for zero3 in (False, True) for tied in (True, False)}
    theta0 = {tied: whole_parameters(theta0_of(tokenizer, tied)) for tied in (True, False)}
    finish_worker({"runs": runs, "theta0": theta0, "born_partitioned": born_partitioned(tokenizer, f"{args.out}.name")},
                  args.out)


if __name__ == "__main__":
    main()
