"""Offline stand-ins for the Hugging Face Hub models and data sets that TRL's tests/test_grpo_trainer.py loads.

Each stand-in has the real repository's architecture class, random weights at a tiny size, and a byte-level
tokenizer (one id per byte plus the family's special tokens) with the family's chat template, read from the installed
TRL's `trl/chat_templates/` so TRL recognizes it exactly as it recognizes the real one. Models are written into a
Hugging Face hub cache (`<cache>/v<version>/hf/hub/models--org--name/snapshots/<commit>/`), so that with
`HF_HOME=<cache>/v<version>/hf` and `HF_HUB_OFFLINE=1` every `from_pretrained("trl-internal-testing/...")` resolves
them by their Hub ids, as it would resolve a real download, with no patching. Data sets are local folders
(`<cache>/v<version>/datasets/org/name/`, one parquet file per config and split, configs declared in README.md) that
`datasets.load_dataset` reads directly; the pytest plugin maps the Hub ids to them.

`build_cache(cache)` writes everything (idempotent: a stand-in already written at this version is kept).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerFast

# Bumped whenever a stand-in changes: part of every snapshot's commit hash and data set folder, so an old cache is
# rebuilt, not reused.
STANDIN_VERSION = "5"
SEED = 0
# Tiny sizes shared by every architecture (per-family overrides below): a CPU step in well under a second.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 32, 2, 4, 2, 8, 64
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)


@dataclass(frozen=True)
class TokenizerSpec:
    """A family's tokenizer: chat template (a file of trl/chat_templates, or inline text), special tokens, roles."""
    template: str                      # "qwen3.jinja" (read from the installed TRL) or a Jinja template itself
    eos: str
    pad: str | None
    bos: str | None = None
    add_bos: bool = False              # prepend `bos` when encoding (Gemma, Llama), as the real tokenizers do
    extra_special: tuple[str, ...] = ()
    extra_ids: dict = field(default_factory=dict)  # generation_config extras, e.g. Gemma's <end_of_turn> as an eos


@dataclass(frozen=True)
class ModelSpec:
    """One Hub repository: its model_type, head (causal LM or 1-label sequence classifier), config overrides."""
    model_type: str
    tokenizer: TokenizerSpec
    head: str = "causal-lm"            # or "seq-cls"
    config: dict = field(default_factory=dict)
    remote_code: bool = False          # saved with auto_map to a custom class (tiny-RemoteForCausalLM)


QWEN2_5 = TokenizerSpec("qwen2_5.jinja", eos="<|im_end|>", pad="<|endoftext|>")
QWEN3 = TokenizerSpec("qwen3.jinja", eos="<|im_end|>", pad="<|endoftext|>")
LLAMA3_2 = TokenizerSpec("llama3_2.jinja", eos="<|eot_id|>", pad=None, bos="<|begin_of_text|>", add_bos=True,
                         extra_special=("<|finetune_right_pad_id|>", "<|end_of_text|>"))
GEMMA = TokenizerSpec("gemma.jinja", eos="<eos>", pad="<pad>", bos="<bos>", add_bos=True,
                      extra_special=("<start_of_turn>", "<end_of_turn>"),
                      extra_ids={"eos_token_id": ["<eos>", "<end_of_turn>"]})
COHERE2 = TokenizerSpec("cohere2.jinja", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", bos="<BOS_TOKEN>", add_bos=True)
GLM4MOE = TokenizerSpec("glm4moe.jinja", eos="<|endoftext|>", pad="<|endoftext|>", extra_special=("[gMASK]", "<sop>"),
                        extra_ids={"eos_token_id": ["<|endoftext|>", "<|user|>", "<|observation|>"]})
GPTOSS = TokenizerSpec("gptoss.jinja", eos="<|return|>", pad="<|endoftext|>", bos="<|startoftext|>",
                       extra_ids={"eos_token_id": ["<|return|>", "<|call|>"]})
NEMOTRON = TokenizerSpec("nemotron_3_nano.jinja", eos="<|im_end|>", pad="<pad>", bos="<s>")

QWEN_MOE = dict(num_local_experts=4, decoder_sparse_step=1, **MOE)
ORG = "trl-internal-testing"
HUB_MODELS: dict[str, ModelSpec] = {
    f"{ORG}/tiny-Qwen2ForCausalLM-2.5": ModelSpec("qwen2", QWEN2_5, config=dict(tie_word_embeddings=True)),
    f"{ORG}/tiny-Qwen2ForSequenceClassification-2.5": ModelSpec("qwen2", QWEN2_5, head="seq-cls"),
    f"{ORG}/tiny-Qwen3ForCausalLM": ModelSpec("qwen3", QWEN3, config=dict(tie_word_embeddings=False)),
    f"{ORG}/tiny-Qwen3ForSequenceClassification": ModelSpec("qwen3", QWEN3, head="seq-cls"),
    f"{ORG}/tiny-Qwen3MoeForCausalLM": ModelSpec("qwen3_moe", QWEN3, config=QWEN_MOE),
    f"{ORG}/tiny-LlamaForCausalLM-3.2": ModelSpec("llama", LLAMA3_2, config=dict(tie_word_embeddings=True)),
    f"{ORG}/tiny-LlamaForSequenceClassification-3.2": ModelSpec("llama", LLAMA3_2, head="seq-cls"),
    f"{ORG}/tiny-Gemma2ForCausalLM": ModelSpec("gemma2", GEMMA, config=dict(query_pre_attn_scalar=HEAD_DIM,
                                                                             sliding_window=64)),
    f"{ORG}/tiny-Cohere2ForCausalLM": ModelSpec("cohere2", COHERE2, config=dict(sliding_window=64)),
    f"{ORG}/tiny-Glm4MoeForCausalLM": ModelSpec("glm4_moe", GLM4MOE, config=dict(
        n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, num_nextn_predict_layers=0, **MOE)),
    f"{ORG}/tiny-GptOssForCausalLM": ModelSpec("gpt_oss", GPTOSS, config=dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"], rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0})),
    f"{ORG}/tiny-NemotronHForCausalLM-nano": ModelSpec("nemotron_h", NEMOTRON, config=dict(
        n_routed_experts=4, n_shared_experts=1,   # layers_block_type: nemotron_layers(), at build
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, num_experts_per_tok=2,
        ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, chunk_size=16, num_hidden_layers=3)),
    f"{ORG}/tiny-RemoteForCausalLM": ModelSpec("qwen2", QWEN2_5, remote_code=True),
}

# The custom code of tiny-RemoteForCausalLM: a Qwen2 model under another name, loadable only with trust_remote_code.
REMOTE_CONFIG_PY = '''from transformers import Qwen2Config


class RemoteConfig(Qwen2Config):
    model_type = "remote"
'''
REMOTE_MODELING_PY = '''from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteConfig
'''

# Short prompts in the formats of trl-internal-testing/zen's configs (the real one holds the Zen of Python).
# Six training prompts (the real zen has more): each test trains num_train_epochs x 6 prompts' steps, and the file runs
# about 120 training tests per trainer on a CPU.
ZEN_TRAIN = ["Clear code is better than", "Flat is better than", "Readability", "Errors should never",
             "Now is better than", "Simple is better than"]
ZEN_TEST = ["Beautiful is better than", "Complex is better than"]
DATASET_CONFIGS = ("standard_prompt_only", "conversational_prompt_only")
HUB_DATASETS = {f"{ORG}/zen": DATASET_CONFIGS}


def commit_hash(repo_id: str) -> str:
    """The snapshot's fake 40-hex commit: fixed per repository and STANDIN_VERSION."""
    return hashlib.sha1(f"erpo-trl-standin/{STANDIN_VERSION}/{repo_id}".encode()).hexdigest()


def versioned(cache: str | os.PathLike) -> Path:
    """This STANDIN_VERSION's part of `cache`: runs of two versions never share a hub cache's refs."""
    return Path(cache) / f"v{STANDIN_VERSION}"


def hub_home(cache: str | os.PathLike) -> Path:
    """HF_HOME for a test run over `cache` (hub cache, modules and datasets caches all live under it)."""
    return versioned(cache) / "hf"


def dataset_dir(cache: str | os.PathLike, repo_id: str) -> Path:
    """Local folder of the stand-in for the Hub data set `repo_id`."""
    return versioned(cache) / "datasets" / repo_id


def snapshot_dir(cache: str | os.PathLike, repo_id: str) -> Path:
    """Folder of `repo_id`'s stand-in inside the hub cache, where `from_pretrained(repo_id)` finds it offline."""
    return hub_home(cache) / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit_hash(repo_id)


def chat_template(name_or_text: str) -> str:
    """A template of the installed TRL's trl/chat_templates (by file name), else the text itself."""
    if not name_or_text.endswith(".jinja"):
        return name_or_text
    return (resources.files("trl") / "chat_templates" / name_or_text).read_text()


def template_special_tokens(template: str) -> list[str]:
    """The control tokens a template writes: `<|...|>` markers and Cohere's `<..._TOKEN>`, in order of appearance."""
    found = re.findall(r"<\|[A-Za-z0-9_.:\-]+\|>|<[A-Z_]+_TOKEN>", template)
    return list(dict.fromkeys(found))


def byte_symbols() -> list[str]:
    """The 256 byte-level symbols in GPT-2's vocabulary order (printable bytes first, then the others shifted past
    255): every text tokenizes, one id per UTF-8 byte, at the ids GPT-2 and Qwen give single bytes."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def build_tokenizer(spec: TokenizerSpec, name: str) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges: one id per byte (GPT-2's order), then the family's special tokens; its
    chat template."""
    template = chat_template(spec.template)
    named = [t for t in (spec.pad, spec.eos, spec.bos) if t]
    specials = list(dict.fromkeys(named + list(spec.extra_special) + template_special_tokens(template)))
    vocab = {token: i for i, token in enumerate(byte_symbols() + specials)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if spec.add_bos:
        bos = (spec.bos, vocab[spec.bos])
        backend.post_processor = processors.TemplateProcessing(single=f"{spec.bos} $A", pair=f"{spec.bos} $A $B",
                                                               special_tokens=[bos])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=spec.eos, pad_token=spec.pad,
                                        bos_token=spec.bos, padding_side="left" if spec.add_bos else "right")
    tokenizer.chat_template = template
    tokenizer.name_or_path = name
    return tokenizer


def nemotron_layers() -> list[str]:
    """Nemotron-H's three layer kinds (mamba, MoE, attention) as the installed transformers names them (5.10's
    "mamba" / "attention" became "linear_attention" / "full_attention" in later releases)."""
    from transformers import NemotronHConfig
    older = ["mamba", "moe", "attention"]
    try:
        NemotronHConfig(layers_block_type=older, num_hidden_layers=len(older))
    except Exception:   # huggingface_hub's StrictDataclassClassValidationError, around the ValueError
        return ["linear_attention", "moe", "full_attention"]
    return older


def build_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast):
    """The tiny config of `spec`'s architecture for `tokenizer`'s vocabulary."""
    sizes = dict(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=INTERMEDIATE,
                 max_position_embeddings=4096)
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.bos_token_id)
    layers = dict(layers_block_type=nemotron_layers()) if spec.model_type == "nemotron_h" else {}
    config = AutoConfig.for_model(spec.model_type, **{**sizes, **ids, **layers, **spec.config})
    if spec.head == "seq-cls":
        config.num_labels = 1
    return config


def build_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast):
    """A freshly initialised (seeded, fp32) model of `spec` for `tokenizer`."""
    config = build_config(spec, tokenizer)
    auto = AutoModelForSequenceClassification if spec.head == "seq-cls" else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = auto.from_config(config, dtype=torch.float32)
    if spec.head == "seq-cls":
        return model
    extra = {key: [tokenizer.convert_tokens_to_ids(t) for t in tokens]
             for key, tokens in spec.tokenizer.extra_ids.items()}
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = extra.get("eos_token_id", tokenizer.eos_token_id)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def write_model(cache: str | os.PathLike, repo_id: str, spec: ModelSpec) -> Path:
    """Save `repo_id`'s stand-in (weights, config, tokenizer, generation config) as its hub-cache snapshot."""
    folder = snapshot_dir(cache, repo_id)
    if (folder / "config.json").exists():
        return folder
    tokenizer = build_tokenizer(spec.tokenizer, repo_id)
    model = build_model(spec, tokenizer)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # Load the tokenizer back as the one saved (tokenizer.json), not a family class rebuilding its own pre-tokenizer.
    tokenizer_config = json.loads((tmp / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    if spec.remote_code:
        config = json.loads((tmp / "config.json").read_text())
        config.update(model_type="remote", architectures=["RemoteForCausalLM"], auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "configuration_remote.py").write_text(REMOTE_CONFIG_PY)
        (tmp / "modeling_remote.py").write_text(REMOTE_MODELING_PY)
    tmp.rename(folder)
    refs = folder.parent.parent / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main").write_text(commit_hash(repo_id))
    return folder


def zen_rows(config_name: str, prompts: list[str]) -> list[dict]:
    """Rows of one zen config: plain-text prompts, or the same prompts as one user message."""
    if config_name == "standard_prompt_only":
        return [{"prompt": p} for p in prompts]
    return [{"prompt": [{"role": "user", "content": p}]} for p in prompts]


def write_dataset(cache: str | os.PathLike, repo_id: str) -> Path:
    """Save the zen stand-in: one parquet file per config and split, configs declared in README.md's YAML."""
    from datasets import Dataset

    folder = dataset_dir(cache, repo_id)
    if (folder / "README.md").exists():
        return folder
    lines = ["---", "configs:"]
    for config_name in HUB_DATASETS[repo_id]:
        lines += [f"- config_name: {config_name}", "  data_files:"]
        for split, prompts in (("train", ZEN_TRAIN), ("test", ZEN_TEST)):
            Dataset.from_list(zen_rows(config_name, prompts)).to_parquet(str(folder / config_name / f"{split}.parquet"))
            lines += [f"  - split: {split}", f"    path: {config_name}/{split}.parquet"]
    (folder / "README.md").write_text("\n".join(lines + ["---", ""]))
    return folder


def build_cache(cache: str | os.PathLike) -> Path:
    """Write every stand-in model and data set under `cache`; returns the HF_HOME to run the tests with."""
    for repo_id, spec in HUB_MODELS.items():
        write_model(cache, repo_id, spec)
    for repo_id in HUB_DATASETS:
        write_dataset(cache, repo_id)
    return hub_home(cache)
