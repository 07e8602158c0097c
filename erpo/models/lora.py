"""LoRA adapters on a causal LM (PEFT): apply them, use the adapter-free model as the reference, and hand the
merged weights to an inference engine or a Hugging Face export.

theta = W + (alpha / r) B A on each adapted linear layer; B starts at zero, so the adapted model starts exactly at
theta0 and the model with its adapters disabled *is* theta0 for the whole run. GRPO's Policy-KL therefore reads
its reference from the same weights (`reference_model`), and ERPO's Query-KL from the cache built before RL:
no second copy of the model is held.

Merged weights are computed per layer into a fresh tensor (`inference_weights`), the result PEFT's
`merge_adapter()` writes in place: vLLM and the merged export get the same values as TRL's merge / sync / unmerge,
while the trainer's base weights are never written (a bf16 merge followed by an unmerge does not give back the
same bits). Under DeepSpeed ZeRO-3 each layer's base weight and adapters are gathered while it is merged.

PEFT is optional (`pip install 'erpo[lora]'`): it is imported only when adapters are applied or loaded.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from erpo import distributed as D
from erpo.config import LoraConfig
from erpo.errors import MissingPackageError
from erpo.models.weights import save_pretrained_atomically, unwrap_model

ADAPTER_CONFIG = "adapter_config.json"   # what marks a directory as a PEFT adapter
MERGED_DIR = "merged"                     # the merged model, inside an adapter export (model.lora.export_merged)
ALL_LINEAR = "all-linear"                 # PEFT's "every linear layer but the output layer"


def import_peft():
    """The `peft` module, or a MissingPackageError (an ImportError) saying how to install it."""
    try:
        return importlib.import_module("peft")
    except ImportError as exc:
        raise MissingPackageError(f"model.lora needs PEFT: pip install 'erpo[lora]' (import failed: {exc})") from exc


def peft_model_of(model):
    """The PEFT model inside `model` (itself, or a DeepSpeed engine / DDP wrapper around one), or None when `model`
    has no adapters. Never imports PEFT: a model cannot hold adapters unless PEFT was imported."""
    peft = sys.modules.get("peft")
    module = unwrap_model(model)
    return module if peft is not None and isinstance(module, peft.PeftModel) else None


def is_lora_model(model) -> bool:
    return peft_model_of(model) is not None


def apply_lora(model, lora: LoraConfig):
    """Wrap the causal LM `model` with LoRA adapters per `lora` (rank > 0) and return the PEFT model; only the
    adapter parameters are trainable afterwards. The output layer (and the input embedding tied to it) is refused:
    the fused-linear loss reads `lm_head.weight` directly, so an adapter there would be silently ignored."""
    if lora.rank <= 0:
        raise ValueError(f"apply_lora needs model.lora.rank > 0, got {lora.rank}")
    peft = import_peft()
    targets = ALL_LINEAR if lora.target_modules == [ALL_LINEAR] else list(lora.target_modules)
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                             bias="none", task_type="CAUSAL_LM")
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    try:
        adapted = peft.get_peft_model(model, config)
    except ValueError as exc:   # PEFT: "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules {lora.target_modules}: {str(exc).splitlines()[0]}") from None
    from peft.tuners.lora import LoraLayer
    for name, module in adapted.named_modules():
        layer = module.get_base_layer() if isinstance(module, LoraLayer) else None
        if layer is not None and (layer is head or (tied and layer is embedding)):
            what = "the output layer" if layer is head else "the input embedding tied to the output layer"
            raise ValueError(f"model.lora.target_modules {lora.target_modules} adapts {name.split('.')[-1]}, {what}: "
                             "the fused-linear loss reads the output layer's weight directly and would ignore the "
                             "adapter; remove it from the list")
    return adapted


@contextlib.contextmanager
def reference_model(model):
    """Yield `model` (a PEFT model, or a DeepSpeed engine around one) with its adapters switched off while the block
    runs: theta0, the reference of GRPO's Policy-KL and of the k3-token Query-KL, without a frozen copy."""
    peft_model = peft_model_of(model)
    if peft_model is None:
        raise TypeError(f"reference_model needs a model with LoRA adapters, got {type(unwrap_model(model)).__name__}")
    with peft_model.disable_adapter():
        yield model


class AdaptersDisabled:
    """The policy `model` (a PEFT model, or a DeepSpeed engine around one) seen with its adapters switched off, where
    the trainer takes a reference model: calling it runs the policy's forward under `reference_model`, its
    `get_output_embeddings()` is the policy's lm_head (which adapters never touch), `get_decoder()` its decoder
    (whose output the scoring keeps, `erpo.sequences.final_hidden`) and `config` its config (the logit transform
    the scoring reads)."""

    def __init__(self, model):
        self.model = model

    @property
    def config(self):
        return unwrap_model(self.model).config

    def __call__(self, *args, **kwargs):
        with reference_model(self.model):
            return self.model(*args, **kwargs)

    def get_output_embeddings(self):
        return unwrap_model(self.model).get_output_embeddings()

    def get_decoder(self):
        return unwrap_model(self.model).get_decoder()


def parameter_count(param: torch.Tensor) -> int:
    """Elements of a parameter, also when DeepSpeed ZeRO-3 holds only this rank's shard of it."""
    return int(getattr(param, "ds_numel", param.numel()))


def held_parameters_line(model, *, reference_needed: bool) -> str:
    """One log line: trainable adapter parameters, parameters held, and what a frozen reference copy would add."""
    peft_model = peft_model_of(model)
    params = list(peft_model.parameters())
    held = sum(parameter_count(p) for p in params)
    adapters = sum(parameter_count(p) for p in params if p.requires_grad)
    base = held - adapters
    line = (f"LoRA: {adapters / 1e6:,.2f}M trainable adapter parameters ({100 * adapters / held:.2f}%); "
            f"parameters held: {held / 1e6:,.2f}M")
    if reference_needed:
        return line + (f", the reference is the same model with adapters disabled (a frozen copy would hold "
                       f"{(held + base) / 1e6:,.2f}M)")
    return line + " (no reference model is needed: the Query-KL reads the cached ell_theta0(q))"


def inference_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every parameter of `model` under the causal LM's own names (as `from_pretrained` and
    vLLM's `load_weights` expect), with LoRA adapters merged: W + sum over active adapters of (alpha / r) B A.
    Without adapters, the model's own parameters. Each tensor is whole (gathered from ZeRO-3 shards: collective,
    every rank iterates) and valid until the next item; the model itself is left unchanged."""
    peft_model = peft_model_of(model)
    if peft_model is None:
        for name, param in unwrap_model(model).named_parameters():
            with D.gathered([param]):
                yield name, param.data
        return
    from peft.tuners.lora import LoraLayer
    layers = {id(m.get_base_layer().weight): m for m in peft_model.modules() if isinstance(m, LoraLayer)}
    for name, param in peft_model.get_base_model().named_parameters():
        if peft_model.prefix in name:          # an adapter's A or B: merged into its base weight
            continue
        layer = layers.get(id(param))
        adapter_params = [] if layer is None else [p for n, p in layer.named_parameters() if peft_model.prefix in n]
        with D.gathered([param, *adapter_params]):
            weight = param.data
            if layer is not None and not layer.merged and not layer.disable_adapters:
                weight = weight.clone()
                for adapter in layer.active_adapters:
                    weight += layer.get_delta_weight(adapter)     # as PEFT's merge: in place, in W's dtype
            yield name.replace(".base_layer.", "."), weight


def export_adapter(model, tokenizer, out_dir: str | os.PathLike) -> str:
    """Write the adapters (PEFT `save_pretrained`: adapter_config.json + adapter_model.safetensors) and `tokenizer`
    into `out_dir`, loadable by `erpo.models.loading.load_causal_lm` and `erpo eval`. Collective under ZeRO-3;
    rank 0 writes;
    atomic. Returns out_dir."""
    peft_model = peft_model_of(model)
    adapter_params = [(n, p) for n, p in peft_model.named_parameters() if peft_model.prefix in n]
    state_dict = {}
    for name, param in adapter_params:
        with D.gathered([param]):
            if D.is_main():
                state_dict[name] = param.data.detach().to("cpu", copy=True)

    # save_embedding_layers=False: PEFT's "auto" would ask the Hub whether the vocabulary was resized
    return save_pretrained_atomically(peft_model, state_dict, tokenizer, out_dir, save_embedding_layers=False)


def export_merged(model, tokenizer, out_dir: str | os.PathLike) -> str:
    """Write the merged model (base + adapters, `inference_weights`) and `tokenizer` as one Hugging Face model into
    `out_dir` (config.json + safetensors), loadable by `from_pretrained` and vLLM. Collective under ZeRO-3 (one
    layer gathered at a time); rank 0 holds the merged state dict on CPU and writes; atomic. Returns out_dir."""
    base = peft_model_of(model).get_base_model()
    state_dict = {}
    for name, tensor in inference_weights(model):
        if D.is_main():
            state_dict[name] = tensor.detach().to("cpu", copy=True)
    return save_pretrained_atomically(base, state_dict, tokenizer, out_dir)


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a PEFT adapter directory (adapter_config.json)."""
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def adapter_base(path: str | os.PathLike) -> str:
    """The base model (local path or Hub name) that the adapter directory `path` adapts: its adapter config's
    base_model_name_or_path. ValueError when it names none."""
    base_path = json.loads(Path(path, ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base_path:
        raise ValueError(f"{path}: {ADAPTER_CONFIG} names no base_model_name_or_path; cannot load the adapter")
    return base_path


def load_merged_adapter(path: str, **kwargs):
    """The adapter directory `path` as one plain causal LM: its base model (`adapter_base`,
    `from_pretrained(..., **kwargs)`) with the adapters loaded and merged in."""
    from transformers import AutoModelForCausalLM
    base_path = adapter_base(path)
    peft = import_peft()
    base = AutoModelForCausalLM.from_pretrained(base_path, **kwargs)
    return peft.PeftModel.from_pretrained(base, path).merge_and_unload()
