"""Rollout engines: sample n responses per prompt with the current policy. `engine` holds the interface, `hf` the
transformers engine (CPU, tests), `vllm` the GPU engine (optional extra; vLLM itself is imported only when a
`VLLMRollout` is created). `make_rollout_engine` / `rollout_engine_for` build the one a run or `erpo eval` asks
for (`rollout.engine` / `erpo eval --engine`: hf | vllm)."""
from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from erpo.config import Config, RolloutConfig
from erpo.errors import setting_value
from erpo.models.loading import torch_dtype
from erpo.rollout.hf import HFRollout
from erpo.rollout.vllm import VLLMRollout

log = logging.getLogger("erpo")
VLLM_ONLY_SETTINGS = ("gpu_memory_utilization", "tensor_parallel_size", "enable_sleep_mode")  # rollout.*
# the engine's keywords as a training run's user spells them, in its errors: the config keys
CONFIG_NAMES = {key: f"rollout.{key}" for key in VLLM_ONLY_SETTINGS}


def make_rollout_engine(engine: str, *, model_path: str, model=None, tokenizer=None, batch_size: int = 1,
                        dtype: str = "auto", seed: int = 0, gpu_memory_utilization: float = 0.9,
                        tensor_parallel_size: int = 1, enable_sleep_mode: bool = False,
                        max_model_len: int | None = None, colocated: bool = True,
                        names: Mapping[str, str] | None = None):
    """A rollout engine: "hf" generates with `model` / `tokenizer` in `batch_size` prompts per call; "vllm" loads
    `model_path` into vLLM (dtype a name such as "bfloat16"; the remaining options are vLLM's, `names` how the
    caller's user spells them, which its errors use (`VLLMRollout`); colocated=False lets vLLM start its own
    tensor-parallel workers, for evaluation outside a training run)."""
    if engine == "vllm":
        llm_kwargs = {"max_model_len": max_model_len} if max_model_len is not None else None
        return VLLMRollout(model_path, tensor_parallel_size=tensor_parallel_size,
                           gpu_memory_utilization=gpu_memory_utilization, dtype=dtype, seed=seed,
                           enable_sleep_mode=enable_sleep_mode, llm_kwargs=llm_kwargs, colocated=colocated,
                           names=names)
    return HFRollout(model, tokenizer, batch_size=batch_size)


def warn_vllm_only_settings(rollout: RolloutConfig) -> None:
    """One warning per vLLM-only setting set away from its default while the engine is not vLLM (it is ignored)."""
    if rollout.engine == "vllm":
        return
    defaults = RolloutConfig()
    for key in VLLM_ONLY_SETTINGS:
        if getattr(rollout, key) != getattr(defaults, key):
            log.warning("%s is ignored by the %s engine (vLLM only: rollout.engine=vllm)",
                        setting_value(CONFIG_NAMES, key, getattr(rollout, key)), rollout.engine)


def rollout_engine_for(cfg: Config, model, tokenizer, model_path: str):
    """The training run's rollout engine (`rollout.engine`), sampling from the policy `model`."""
    r = cfg.rollout
    warn_vllm_only_settings(r)
    return make_rollout_engine(r.engine, model_path=model_path, model=model, tokenizer=tokenizer,
                               batch_size=max(1, cfg.trainer.micro_batch_size),
                               dtype="bfloat16" if torch_dtype(cfg) == torch.bfloat16 else "float32",
                               seed=cfg.trainer.seed, gpu_memory_utilization=r.gpu_memory_utilization,
                               tensor_parallel_size=r.tensor_parallel_size, enable_sleep_mode=r.enable_sleep_mode,
                               max_model_len=cfg.data.max_prompt_length + r.max_new_tokens, names=CONFIG_NAMES)
