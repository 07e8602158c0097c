"""The Hugging Face export of a trained model: `save_pretrained` files loadable by transformers, vLLM and
`erpo eval` (a LoRA model: its adapters), written atomically; a checkpoint keeps one in `step-N/hf/`."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from erpo import distributed as dist_utils
from erpo.models.lora import export_adapter, is_adapter_dir, is_lora_model
from erpo.models.weights import (
    gathered_state_dict,
    link_or_copy,
    save_pretrained_atomically,
    unwrap_model,
    write_dir_atomically,
)

HF_DIR = "hf"   # a checkpoint's Hugging Face export: checkpoints/step-N/hf


def export_hf(model: Any, tokenizer: Any, out_dir: str | os.PathLike) -> str:
    """Write `model` (+ `tokenizer` when not None) with `save_pretrained` (safetensors) into `out_dir`,
    loadable by `transformers.AutoModelForCausalLM.from_pretrained` and by vLLM; a LoRA model's adapters alone
    (`erpo.models.lora.export_adapter`). Collective under DeepSpeed (ZeRO-3 parameters are gathered one by one); rank 0
    writes. Atomic: written to a sibling temporary directory, then renamed over `out_dir`. Returns out_dir.
    """
    module = unwrap_model(model)
    if is_lora_model(module):
        return export_adapter(model, tokenizer, out_dir)
    if not hasattr(module, "save_pretrained"):
        raise TypeError(f"model must be a transformers PreTrainedModel (or wrap one), got {type(module).__name__}")
    return save_pretrained_atomically(module, gathered_state_dict(module), tokenizer, out_dir)


def is_hf_export(path: str | os.PathLike) -> bool:
    """Whether `path` holds an `export_hf` result: a model (config.json) or LoRA adapters (adapter_config.json)."""
    return (Path(path) / "config.json").is_file() or is_adapter_dir(path)


def publish_hf(export_dir: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Make `out_dir` hold the same files as the Hugging Face export `export_dir` (a checkpoint's `hf/`) without a
    second gather or a second copy on disk: each file is a hard link, or a copy where the file system has no
    links. Pruning the checkpoint later leaves `out_dir` whole. Rank 0 writes; atomic like `export_hf`; a
    collective barrier. Returns out_dir."""
    source = Path(export_dir)
    if dist_utils.is_main() and not is_hf_export(source):
        raise FileNotFoundError(f"{source} is not a Hugging Face export (no config.json or adapter_config.json)")

    def write(tmp: Path) -> None:
        shutil.copytree(source, tmp, copy_function=link_or_copy)
    return write_dir_atomically(out_dir, write)


