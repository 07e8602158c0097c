"""Loading models, tokenizers and rollout engines, for training, evaluation and the reference cache alike.

Training passes its config (`model_path_for`, `load_model`, `rollout_engine_for`); evaluation calls the
config-free pieces underneath (`load_tokenizer`, `load_causal_lm`, `make_rollout_engine`), so a model is loaded
and sampled the same way everywhere and evaluation does not import the trainer.
"""
from __future__ import annotations

import torch

from erpo import distributed as D
from erpo.config import Config
from erpo.model_source import resolve_model_source


def model_path_for(cfg: Config) -> str:
    """The pre-RL model theta0: the tiny model's cached SFT warm start, or `model.name_or_path` (a local directory
    or a Hub model that can be had, else a one-line UserError)."""
    if cfg.model.name_or_path == "tiny":
        from erpo.sft import tiny_theta0
        path = tiny_theta0(cfg) if D.is_main() else None
        D.barrier()
        return path or tiny_theta0(cfg)
    return resolve_model_source(cfg.model.name_or_path, "model.name_or_path")


def load_tokenizer(path: str):
    """The tokenizer at `path` (HF dir or Hub name); a missing pad token becomes the EOS token."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_for(cfg: Config, model_path: str):
    """The run's tokenizer: `model.tokenizer` (checked as model.name_or_path is), else the model's own."""
    if cfg.model.tokenizer is None:
        return load_tokenizer(model_path)
    return load_tokenizer(resolve_model_source(cfg.model.tokenizer, "model.tokenizer"))


def torch_dtype(cfg: Config) -> torch.dtype:
    """`model.dtype` as a torch dtype ("auto": bf16 on CUDA, fp32 on CPU)."""
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, cfg.model.dtype)


def load_causal_lm(path: str, *, dtype, device, trainable: bool = False, gradient_checkpointing: bool = False,
                   attn_implementation: str | None = None):
    """A transformers causal LM on `device`: in train mode (no KV cache, optional non-reentrant gradient
    checkpointing) when `trainable`, else frozen in eval mode. dtype: a torch dtype or "auto" (the checkpoint's).
    `path` may be a LoRA adapter directory: its base model with the adapters merged in (`erpo.lora`)."""
    from transformers import AutoModelForCausalLM

    from erpo.lora import is_adapter_dir, load_merged_adapter
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    load = load_merged_adapter if is_adapter_dir(path) else AutoModelForCausalLM.from_pretrained
    model = load(path, **kwargs)
    if trainable:
        if gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.x name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        return model.to(device).train()
    model.requires_grad_(False)
    return model.to(device).eval()


def load_model(cfg: Config, model_path: str, device, *, trainable: bool):
    """The run's model (policy when `trainable`, else a frozen reference) with cfg.model's dtype and options; the
    policy carries LoRA adapters when model.lora.rank > 0 (only they are trainable)."""
    model = load_causal_lm(model_path, dtype=torch_dtype(cfg), device=device, trainable=trainable,
                           gradient_checkpointing=cfg.model.gradient_checkpointing,
                           attn_implementation=cfg.model.attn_implementation)
    if trainable and cfg.model.lora.rank:
        from erpo.lora import apply_lora
        model = apply_lora(model, cfg.model.lora)
    return model


def device_for_rank() -> torch.device:
    """This rank's GPU (LOCAL_RANK) when CUDA is available, else the CPU."""
    return torch.device("cuda", D.local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def make_rollout_engine(engine: str, *, model_path: str, model=None, tokenizer=None, batch_size: int = 1,
                        dtype: str = "auto", seed: int = 0, gpu_memory_utilization: float = 0.9,
                        tensor_parallel_size: int = 1, enable_sleep_mode: bool = False,
                        max_model_len: int | None = None, colocated: bool = True):
    """A rollout engine: "hf" generates with `model` / `tokenizer` in `batch_size` prompts per call; "vllm" loads
    `model_path` into vLLM (dtype a name such as "bfloat16"; the remaining options are vLLM's; colocated=False
    lets vLLM start its own tensor-parallel workers, for evaluation outside a training run)."""
    if engine == "vllm":
        from erpo.rollout_vllm import VLLMRollout
        llm_kwargs = {"max_model_len": max_model_len} if max_model_len is not None else None
        return VLLMRollout(model_path, tensor_parallel_size=tensor_parallel_size,
                           gpu_memory_utilization=gpu_memory_utilization, dtype=dtype, seed=seed,
                           enable_sleep_mode=enable_sleep_mode, llm_kwargs=llm_kwargs, colocated=colocated)
    from erpo.rollout import HFRollout
    return HFRollout(model, tokenizer, batch_size=batch_size)


def rollout_engine_for(cfg: Config, model, tokenizer, model_path: str):
    """The training run's rollout engine (`rollout.engine`), sampling from the policy `model`."""
    r = cfg.rollout
    return make_rollout_engine(r.engine, model_path=model_path, model=model, tokenizer=tokenizer,
                               batch_size=max(1, cfg.trainer.micro_batch_size),
                               dtype="bfloat16" if torch_dtype(cfg) == torch.bfloat16 else "float32",
                               seed=cfg.trainer.seed, gpu_memory_utilization=r.gpu_memory_utilization,
                               tensor_parallel_size=r.tensor_parallel_size, enable_sleep_mode=r.enable_sleep_mode,
                               max_model_len=cfg.data.max_prompt_length + r.max_new_tokens)
