"""A model's whole weights and writing them to a directory: unwrapping DeepSpeed / DDP / torch.compile, gathering
ZeRO-3 partitioned parameters, and publishing a `save_pretrained` directory atomically (rank 0 writes).
Used by the Hugging Face export (erpo.models.export), the LoRA adapter export and the checkpoints."""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from erpo import distributed as dist_utils
from erpo.atomic import publish
from erpo.storage_errors import agree_on_writes


def parameter_names(model: torch.nn.Module, *, trainable: bool) -> list[str]:
    """Sorted state-dict names (tied names included) of `model`'s trainable or of its frozen parameters. Frozen
    ones (a LoRA model's base weights) are what checkpoints leave out."""
    return sorted(name for name, param in model.named_parameters(remove_duplicate=False)
                  if param.requires_grad == trainable)


def unwrap_model(model: Any) -> torch.nn.Module:
    """The underlying transformers model of a DeepSpeed engine, DDP wrapper or torch.compile'd module."""
    while True:
        if dist_utils.is_deepspeed_engine(model) or isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Full CPU state dict on rank 0 (None on other ranks), gathering ZeRO-3 partitioned parameters one
    at a time so no rank ever holds more than one whole parameter beyond its shard. Collective."""
    tensors = model.state_dict(keep_vars=True)
    copies: dict[int, torch.Tensor] = {}
    result: dict[str, torch.Tensor] | None = {} if dist_utils.is_main() else None
    for name, tensor in tensors.items():
        key = id(tensor)
        if key not in copies:
            with dist_utils.gathered([tensor]):
                copies[key] = tensor.detach().to("cpu", copy=True) if result is not None else None
        if result is not None:
            result[name] = copies[key]
    return result


def save_pretrained_atomically(model, state_dict: dict | None, tokenizer, out_dir: str | os.PathLike,
                               **save_kwargs) -> str:
    """`model.save_pretrained(state_dict=...)` (a transformers or PEFT model; safetensors) and the tokenizer, if
    any, into `out_dir`, published by `write_dir_atomically`. Returns out_dir."""
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return write_dir_atomically(out_dir, write)


def link_or_copy(source: str, target: str) -> None:
    """Hard-link `source` to `target`; copy it (with metadata) where linking is refused (other device, no links)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def write_dir_atomically(out_dir: str | os.PathLike, write: Callable[[Path], None]) -> str:
    """Rank 0 publishes `out_dir` with `erpo.atomic.publish` (`write(tmp)` fills a temporary directory unique to
    this call, which replaces `out_dir` in one rename: concurrent exports to one place never mix, a crash leaves
    the old `out_dir` or the new one); then every rank learns whether it succeeded (`agree_on_writes`: a failed
    write stops every rank, none waits for rank 0)."""
    agree_on_writes(lambda: publish(out_dir, write) if dist_utils.is_main() else None, f"writing {out_dir}",
                    Path(out_dir).parent)
    return str(out_dir)
