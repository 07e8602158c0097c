"""Loading models and tokenizers, for training, evaluation and the reference cache alike.

Training passes its config (`model_path_for`, `load_model`); evaluation calls the config-free pieces underneath
(`load_tokenizer`, `load_causal_lm`), so a model is loaded the same way everywhere and evaluation does not import
the trainer. Rollout engines are built by `erpo.rollout`.
"""
from __future__ import annotations

import logging
import re

import torch

from erpo import distributed as D
from erpo.config import Config
from erpo.models.lora import apply_lora, is_adapter_dir, load_merged_adapter
from erpo.models.sft import tiny_theta0
from erpo.models.source import require, resolve_model_source

log = logging.getLogger("erpo")


def model_path_for(cfg: Config) -> str:
    """The pre-RL model theta0: the tiny model's cached SFT warm start, or `model.name_or_path` (a local directory
    or a Hub model that can be had, else a one-line UserError)."""
    if cfg.model.name_or_path == "tiny":
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
    """The run's tokenizer: `model.tokenizer`, else the model's own (`model_path`: `model_path_for`'s), either
    checked to hold one (`resolve_model_source`)."""
    if cfg.model.tokenizer is None:
        require(model_path, "tokenizer", "model.name_or_path",
                "save the model's tokenizer there, or set model.tokenizer to one")
        return load_tokenizer(model_path)
    return load_tokenizer(resolve_model_source(cfg.model.tokenizer, "model.tokenizer", kind="tokenizer"))


def torch_dtype(cfg: Config) -> torch.dtype:
    """`model.dtype` as a torch dtype ("auto": bf16 on CUDA, fp32 on CPU)."""
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, cfg.model.dtype)


def load_causal_lm(path: str, *, dtype, device, trainable: bool = False, gradient_checkpointing: bool = False,
                   attn_implementation: str | None = None):
    """A transformers causal LM on `device`: in train mode (no KV cache, dropout off: `disable_dropout`, optional
    non-reentrant gradient checkpointing) when `trainable`, else frozen in eval mode. dtype: a torch dtype or "auto"
    (the checkpoint's). `path` may be a LoRA adapter directory: its base model with the adapters merged in
    (`erpo.models.lora`)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    load = load_merged_adapter if is_adapter_dir(path) else AutoModelForCausalLM.from_pretrained
    model = load(path, **kwargs)
    if trainable:
        switched_off = disable_dropout(model)
        if switched_off:
            log.info("policy: dropout switched off (%s): ERPO compares the training forward's ell_theta(q) with "
                     "theta0's, scored without dropout", ", ".join(switched_off))
        if gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.x name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        return model.to(device).train()
    model.requires_grad_(False)
    return model.to(device).eval()


DROPOUT_RATE = re.compile(r"dropout|pdrop")   # a module's float attribute holding a rate its forward applies


def dropouts(model: torch.nn.Module, *, skip: str | None = None) -> list[tuple[torch.nn.Module, str, str]]:
    """Every dropout of `model` with a rate > 0, as (module, attribute, "name=rate"): the `p` of its nn.Dropout
    modules and the rates modules apply themselves in train mode (HF's `attention_dropout`, OPT's `dropout`, ...:
    every float attribute named *dropout* / *pdrop*). `skip`: leave out the modules whose qualified name contains
    it (e.g. "lora_dropout", PEFT's adapter dropout)."""
    found = []
    for qualified, module in model.named_modules():
        if skip is not None and skip in qualified:
            continue
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            found.append((module, "p", f"{type(module).__name__} p={module.p:g}"))
        found += [(module, name, f"{name}={rate:g}") for name, rate in vars(module).items()
                  if DROPOUT_RATE.search(name) and isinstance(rate, float) and rate > 0]
    return found


def dropout_labels(found: list[tuple[torch.nn.Module, str, str]]) -> list[str]:
    """The distinct "name=rate" labels of `dropouts`' entries, sorted."""
    return sorted({label for _, _, label in found})


def dropouts_besides_adapters(model: torch.nn.Module) -> list[str]:
    """`dropout_labels` of `model`'s dropouts but PEFT's adapter dropout (lora_dropout, left as the user set it): what
    the integrations refuse with the Query-KL ([] when none)."""
    return dropout_labels(dropouts(model, skip="lora_dropout"))


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout of `model` (`dropouts`) to 0, in place. The policy trains in train mode while ell_theta0(q)
    and the rollout's log-probs are scored without dropout: a model whose config keeps some (OPT's 0.1, Phi-2's
    resid_pdrop) would compare a noisy ell_theta(q) with them, a Query-KL above 0 at theta0 and a push for
    nothing. The config is left as it is (exports keep it). Returns the dropouts that were > 0 ([] when none)."""
    found = dropouts(model)
    for module, name, _ in found:
        setattr(module, name, 0.0)
    return dropout_labels(found)


def load_model(cfg: Config, model_path: str, device, *, trainable: bool):
    """The run's model (policy when `trainable`, else a frozen reference) with cfg.model's dtype and options; the
    policy carries LoRA adapters when model.lora.rank > 0 (only they are trainable)."""
    model = load_causal_lm(model_path, dtype=torch_dtype(cfg), device=device, trainable=trainable,
                           gradient_checkpointing=cfg.model.gradient_checkpointing,
                           attn_implementation=cfg.model.attn_implementation)
    if trainable and cfg.model.lora.rank:
        model = apply_lora(model, cfg.model.lora)
    return model


def device_for_rank() -> torch.device:
    """This rank's GPU (LOCAL_RANK) when CUDA is available, else the CPU."""
    return torch.device("cuda", D.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
