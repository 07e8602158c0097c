"""Typed training configuration (defaults = the built-in tiny CPU run): dataclasses, YAML loading, `--set a.b=c`
overrides, the algorithm presets (erpo.presets) filled in.

A config is a tree of dataclasses. `load_config(path)` reads YAML onto the tree (an unknown key is an
error naming the key and the nearest valid one, else the valid ones), `apply_overrides(cfg, ["a.b=c"])` sets leaves with
the field's type, and `resolve(cfg)` fills the algorithm preset into fields left unset (None) and checks
cross-field constraints. `to_dict(cfg)` gives plain data for YAML dumping.
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from erpo.presets import PRESETS
from erpo.terms import QUERY_WEIGHTS, check_qkl_coef
from erpo_kernels import OPTION_CHOICES, LossOptions, did_you_mean

_KERNEL = LossOptions()   # the kernel's defaults: the algorithm section's defaults for the loss options


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (erpo.models.lora, PEFT: pip install 'erpo[lora]'); rank 0 trains all weights."""
    rank: int = 0                             # r; 0: LoRA off (full fine-tuning)
    alpha: float = 32.0                       # the update is (alpha / rank) * B A
    dropout: float = 0.0                      # on the adapters' input; > 0 makes the policy's forward stochastic
    # Qwen2 / Llama / Mistral names (attention and MLP projections); [all-linear]: every linear layer but lm_head.
    # lm_head (and a tied input embedding) is refused: the fused-linear loss reads the head's weight directly.
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    export_merged: bool = False               # also final/merged/: base + adapters as one HF model


@dataclass
class ModelConfig:
    name_or_path: str = "tiny"               # "tiny": the built-in Qwen2-architecture model, else an HF path
    tokenizer: str | None = None             # defaults to name_or_path
    dtype: str = "auto"                       # auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA, fp32 on CPU)
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None    # e.g. "sdpa", "flash_attention_2"
    cache_dir: str = "~/.cache/erpo"          # where the tiny model's SFT warm start (theta0) is kept
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class TinyConfig:
    """The built-in default: a tiny Qwen2 model warm-started by a short SFT on arithmetic problems."""
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    sft_steps: int = 600
    sft_batch_size: int = 32
    sft_lr: float = 5e-3
    sft_examples: int = 2000


@dataclass
class DataConfig:
    # "arithmetic" (built in), a .jsonl/.json/.parquet path, or an HF dataset name
    source: str = "arithmetic"
    split: str = "train"
    problem_field: str = "problem"
    answer_field: str = "answer"
    num_examples: int | None = None           # arithmetic: how many problems to generate; else: truncate
    arithmetic_max_operand: int = 10
    template: str = "plain"                   # "paper" (appendix A), "plain", or a format string with {problem}
    use_chat_template: bool = True
    max_prompt_length: int = 64               # in tokens, template included
    # drop empty / too-long / incomplete records with a warning instead of stopping
    skip_invalid: bool = False


@dataclass
class RolloutConfig:
    engine: str = "hf"                        # hf | vllm (the rollout engine that generates responses)
    n: int = 8                                # responses per prompt (K)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    gpu_memory_utilization: float = 0.5       # vLLM only
    tensor_parallel_size: int = 1             # vLLM only
    enable_sleep_mode: bool = False           # vLLM only: free its KV cache and offload its weights while training
    # Truncated importance sampling against the engine's sampling log-probs (TRL's vllm_importance_sampling_correction):
    # pg_t *= min(exp(trainer logp - engine logp), cap). None: on with vllm, off with hf (the same model samples).
    importance_sampling_correction: bool | None = None
    importance_sampling_cap: float = _KERNEL.rollout_is_cap


@dataclass
class RewardConfig:
    functions: list[str] = field(default_factory=lambda: ["math"])  # "math", "format", or "path/file.py:fn"
    weights: list[float] | None = None       # one per function; default all 1.0


# The loss options a run's config does not set under `algorithm`: taken from elsewhere in the config, from the model,
# or from the step itself. Every other field of the kernels' `LossOptions` is a key of `algorithm` with the kernels'
# default (API.md's options table), so a new loss option needs no edit here.
LOSS_OPTIONS_ELSEWHERE = {
    "temperature": "rollout.temperature",
    "rollout_is_cap": "rollout.importance_sampling_cap",
    "logit_scale": "the model's config (its final-logit transform)",
    "logit_softcap": "the model's config (its final-logit transform)",
    "num_items": "each optimizer step (its response tokens over all ranks)",
    "num_seqs": "each optimizer step (its samples over all ranks)",
    "top_entropy_gather": "the trainer (every rank's entropies, under data parallelism)",
}
PRESET_OPTIONS = ("qkl_coef", "policy_kl_coef")   # None in the config until `resolve` fills the preset (PRESETS)
_LOSS_OPTION_TYPES = typing.get_type_hints(LossOptions)
CONFIG_LOSS_OPTIONS = tuple(f.name for f in dataclasses.fields(LossOptions) if f.name not in LOSS_OPTIONS_ELSEWHERE)

AlgorithmLossOptions = dataclasses.make_dataclass(
    "AlgorithmLossOptions",
    [(name, _LOSS_OPTION_TYPES[name] | None, field(default=None)) if name in PRESET_OPTIONS
     else (name, _LOSS_OPTION_TYPES[name], field(default=getattr(_KERNEL, name))) for name in CONFIG_LOSS_OPTIONS])
AlgorithmLossOptions.__doc__ = ("The loss options of `algorithm` (CONFIG_LOSS_OPTIONS), derived from the kernels' "
                                "`LossOptions` with their defaults; qkl_coef and policy_kl_coef come from the preset.")


@dataclass
class AlgorithmConfig(AlgorithmLossOptions):
    """The RL algorithm: the loss options (AlgorithmLossOptions) and the trainer's own choices. `resolve` fills the
    preset and sets `loss_options`: the kernel's `LossOptions` built once from these fields (with the options of
    LOSS_OPTIONS_ELSEWHERE that the config holds: rollout.temperature and rollout.importance_sampling_cap), passed
    whole to the loss."""
    name: str = "erpo"                        # erpo | grpo | grpo+qw | grpo+qkl
    # Left None: the value of the preset for `name` (see PRESETS).
    query_weight: str | None = None          # static (cached w(q)) | current (recomputed per step, clipped to [0, 2])
    #                                          | current-unclipped (the official code's per-step weight) | none
    advantage: str = "grpo"                   # grpo | rloo | reinforce
    scale_rewards: str = "group"              # group | batch | none (grpo: divide by the std, as TRL)
    filter_groups: bool = False               # DAPO: drop groups whose rewards are all equal
    mask_truncated: bool = False              # DAPO overlong masking: truncated responses carry no loss


@dataclass
class TrainerConfig:
    updater: str = "auto"                     # auto | deepspeed | torch: what applies the optimizer step (auto:
                                              # DeepSpeed on CUDA, with several ranks or zero_stage > 0, else torch)
    max_steps: int = 200                      # rollout steps (the paper's "training steps")
    rollout_batch_size: int = 32              # prompts rolled out per rollout step
    update_batch_size: int = 32               # prompts per optimizer step (several updates per rollout)
    micro_batch_size: int = 64                # samples (prompt + response) per forward/backward
    loss_workspace_mib: int = 1024            # the fused-linear loss's workspace_bytes in MiB (its default, 1 GiB):
                                              # more memory, fewer passes over d weight, faster (docs/training.md)
    lr: float = 3e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0                 # cosine decays to lr * min_lr_ratio
    max_grad_norm: float = 1.0
    zero_stage: int = 0
    offload_optimizer: bool = False           # DeepSpeed: optimizer states and the Adam step on CPU (ZeRO >= 1)
    offload_params: bool = False              # DeepSpeed: parameters on CPU between uses (ZeRO-3 only)
    on_nonfinite: str = "skip"                # skip (warn, count, no update) | stop (clear error, checkpoint kept)
    save_steps: int = 0                       # checkpoint every N rollout steps (0: only at the end)
    keep_last: int = 3                        # newest checkpoints kept (older ones deleted after each save)
    keep_every: int = 0                       # also keep every K-th step's checkpoint (a multiple of save_steps),
                                              # the run's history for `erpo eval --model RUN_DIR@all`; 0: off
    save_hf: bool = True                      # every checkpoint also holds the model in HF format (step-N/hf/)
    seed: int = 42
    # torch CPU threads; None: default_cpu_threads() (OMP_NUM_THREADS, else the cores)
    cpu_threads: int | None = None


@dataclass
class ReferenceConfig:
    cache_path: str | None = None             # default OUTPUT_DIR/reference_cache.json
    batch_size: int = 64                      # prompts per forward when precomputing


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    progress_bar: bool = True
    plot: bool = True                         # write plots/training.png at the end


@dataclass
class Config:
    output_dir: str = "runs/erpo-tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    tiny: TinyConfig = field(default_factory=TinyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "rollout.engine": ("hf", "vllm"),
    "algorithm.name": tuple(PRESETS),
    "algorithm.query_weight": QUERY_WEIGHTS,
    "algorithm.advantage": ("grpo", "rloo", "reinforce"),
    "algorithm.scale_rewards": ("group", "batch", "none"),
    "trainer.updater": ("auto", "deepspeed", "torch"),
    "trainer.on_nonfinite": ("skip", "stop"),
    # the loss options with a fixed set of values (the kernels' OPTION_CHOICES), each in its algorithm key
    **{f"algorithm.{name}": choices for name, choices in OPTION_CHOICES.items() if name in CONFIG_LOSS_OPTIONS},
}


# Old spellings of renamed keys, still read (each name now says one thing: the rollout engine, the updater).
RENAMED_KEYS = {"rollout.backend": "rollout.engine", "trainer.backend": "trainer.updater"}


def _current_key(dotted: str) -> str:
    """`dotted` under its current name (see RENAMED_KEYS)."""
    return RENAMED_KEYS.get(dotted, dotted)


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert `value` (from YAML or a --set string) to the annotated type `tp`, or raise naming `key`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        # "none" / "null" / "~" leave an optional key unset (None: its default or preset), except where "none" is one
        # of the key's values in any case (algorithm.query_weight=none: w = 1, not the preset's static weight; "None"
        # there is then checked against the values, not read as unset)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")
                             and value.lower() not in {choice.lower() for choice in CHOICES.get(key, ())}):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise TypeError(f"config key '{key}': cannot use {value!r} ({'; '.join(errors)})")
    if origin is list:
        if isinstance(value, str):
            import yaml  # the train extra: here, so the light install's `erpo --help` reads the presets
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"config key '{key}': expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise TypeError(f"config key '{key}': expected true/false, got {value!r}")
    if tp in (int, float):
        # int accepts integers (and integer strings); float accepts any number (and numeric strings); never bools
        accepted = (int,) if tp is int else (int, float)
        what = "an integer" if tp is int else "a number"
        if isinstance(value, accepted) and not isinstance(value, bool):
            return tp(value)
        if isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                pass
        raise TypeError(f"config key '{key}': expected {what}, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise TypeError(f"config key '{key}': expected a string, got {value!r}")
    raise TypeError(f"config key '{key}': unsupported type {tp}")


def set_elsewhere(dotted: str) -> str:
    """For an `algorithm.X` key naming a loss option the config takes from elsewhere (LOSS_OPTIONS_ELSEWHERE, e.g.
    the temperature: one setting for the engine and the loss), where it comes from, as a clause; else ""."""
    section, _, option = dotted.partition(".")
    source = LOSS_OPTIONS_ELSEWHERE.get(option) if section == "algorithm" else None
    return f" (the loss's {option} comes from {source})" if source else ""


def unknown_key(dotted: str, section: str, part: str, known) -> ValueError:
    """The one-line error for the config key `dotted` (YAML's path or `--set`'s), whose `part` is not a key of
    `section` ("" the root; its keys `known`): where the config takes it from (`set_elsewhere`), else the nearest
    key (`did_you_mean`, written in full: 'algorithm.alpha'), else the section's keys."""
    elsewhere = set_elsewhere(dotted)
    if elsewhere:
        return ValueError(f"unknown config key '{dotted}'{elsewhere}")
    prefix = f"{section}." if section else ""
    hint = (did_you_mean(part, known, spelled=lambda key: repr(prefix + key))
            or f"'{part}' is not in {section or '<root>'} (valid: {', '.join(sorted(known))})")
    return ValueError(f"unknown config key '{dotted}': {hint}")


def _update(obj: Any, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise TypeError(f"config section '{prefix.rstrip('.') or '<root>'}': expected a mapping, got {data!r}")
    hints = _field_types(type(obj))
    for key, value in data.items():
        dotted = _current_key(f"{prefix}{key}")
        key = dotted[len(prefix):]
        if key not in hints:
            raise unknown_key(dotted, prefix.rstrip("."), key, hints)
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _update(current, value, f"{dotted}.")
        else:
            setattr(obj, key, _coerce(value, hints[key], dotted))


def from_dict(data: dict | None) -> Config:
    """Build a Config from plain nested data (as read from YAML); unknown keys raise ValueError."""
    cfg = Config()
    _update(cfg, data or {})
    return cfg


def load_config(path: str | None) -> Config:
    """Read a YAML file onto the schema; None gives the built-in tiny default. A file that is not valid YAML is a
    ValueError naming it and the line."""
    if path is None:
        return Config()
    import yaml
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:   # its own message spans several lines: keep the line and the problem
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ValueError(f"{where}: not valid YAML ({getattr(exc, 'problem', None) or exc}); fix the file") from exc
    return from_dict(data)


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `a.b=c` strings in order; the value is parsed with the field's type."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        dotted, raw = item.split("=", 1)
        dotted = _current_key(dotted.strip())
        parts = dotted.split(".")
        obj = cfg
        for depth, part in enumerate(parts):
            hints = _field_types(type(obj))
            if part not in hints:
                raise unknown_key(dotted, ".".join(parts[:depth]), part, hints)
            if depth == len(parts) - 1:
                if dataclasses.is_dataclass(getattr(obj, part)):
                    raise ValueError(f"--set {dotted}: is a section, set one of its keys")
                setattr(obj, part, _coerce(raw, hints[part], dotted))
            else:
                obj = getattr(obj, part)
                if not dataclasses.is_dataclass(obj):
                    raise ValueError(f"unknown config key '{dotted}': '{part}' is not a section")
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    import yaml
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def default_cpu_threads() -> int:
    """OMP_NUM_THREADS when set, else the cores this process may use shared among the ranks on this node
    (LOCAL_WORLD_SIZE): one fixed count per run, recorded in config.yaml, so a run repeats on the same machine."""
    if os.environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, len(os.sched_getaffinity(0)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def updates_per_rollout(cfg: Config) -> int:
    return cfg.trainer.rollout_batch_size // cfg.trainer.update_batch_size


# Temperatures vLLM samples at as asked: SamplingParams raises the temperature of 0 < T < 0.01 to 0.01 without
# error (vllm/sampling_params.py, _MAX_TEMP) and vLLM 0.33 rejects T > 2 at generate. Outside this range the
# sampled distribution is not the one erpo scores at T.
VLLM_TEMPERATURE_RANGE = (0.01, 2.0)


def check_vllm_temperature(temperature: float, name: str = "temperature") -> None:
    """ValueError naming `name` unless vLLM samples at exactly `temperature` (VLLM_TEMPERATURE_RANGE)."""
    low, high = VLLM_TEMPERATURE_RANGE
    if not low <= temperature <= high:
        raise ValueError(f"{name}={temperature} is outside [{low}, {high}], the range in which vLLM samples at the "
                         "temperature it is given (it clamps lower values to 0.01 and rejects higher ones)")


def check_gpu_memory_utilization(fraction: float, name: str) -> None:
    """ValueError naming `name`, the setting as its user gave it (`rollout.gpu_memory_utilization`, `erpo eval
    --gpu-memory-utilization`), unless `fraction`, vLLM's share of each GPU's memory, lies in (0, 1]."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"{name} must be a fraction in (0, 1] (vLLM's share of each GPU's memory), got {fraction!r}")


def resolve_rollout(r: RolloutConfig) -> None:
    """Fill `importance_sampling_correction` (on with vLLM) and check the sampling settings against the engine."""
    if r.temperature <= 0:
        raise ValueError(f"rollout.temperature must be > 0, got {r.temperature}")
    if r.importance_sampling_correction is None:
        r.importance_sampling_correction = r.engine == "vllm"
    if r.engine == "vllm":
        check_vllm_temperature(r.temperature, "rollout.temperature")
        check_gpu_memory_utilization(r.gpu_memory_utilization, "rollout.gpu_memory_utilization")
    if r.importance_sampling_correction and r.top_p < 1:
        # the engine's log-probs are renormalized over the top-p nucleus, the trainer's are the full softmax at T:
        # their ratio would be biased below 1
        raise ValueError(f"rollout.top_p={r.top_p} with rollout.importance_sampling_correction: the engine "
                         "scores tokens over the top-p nucleus and the trainer over the full softmax; set "
                         "rollout.top_p=1.0 or rollout.importance_sampling_correction=false")
    cap = r.importance_sampling_cap
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
        raise ValueError(f"rollout.importance_sampling_cap must be a finite number > 0, got {cap!r} (to turn the "
                         "correction off, set rollout.importance_sampling_correction=false)")


def check_retention(t: TrainerConfig) -> None:
    """trainer.save_steps, keep_last and keep_every: which checkpoints are written and which stay."""
    if t.save_steps < 0 or t.keep_last < 1 or t.keep_every < 0:
        raise ValueError(f"trainer.save_steps must be >= 0, keep_last >= 1 and keep_every >= 0, got save_steps="
                         f"{t.save_steps}, keep_last={t.keep_last}, keep_every={t.keep_every}")
    if t.keep_every and (not t.save_steps or t.keep_every % t.save_steps):
        raise ValueError(f"trainer.keep_every={t.keep_every} keeps checkpoints that are never written: make it a "
                         f"multiple of trainer.save_steps (now {t.save_steps}; 0 saves only at the end)")


def check_lora(lora: LoraConfig) -> None:
    """model.lora's values (rank 0 is LoRA off)."""
    if lora.rank < 0:
        raise ValueError(f"model.lora.rank must be >= 0 (0: LoRA off), got {lora.rank}")
    if not lora.alpha > 0 or not 0 <= lora.dropout < 1:
        raise ValueError(f"model.lora needs alpha > 0 and 0 <= dropout < 1, got alpha={lora.alpha}, "
                         f"dropout={lora.dropout}")
    if not lora.target_modules:
        raise ValueError("model.lora.target_modules is empty; name the modules to adapt, e.g. [q_proj, v_proj]")


def resolve(cfg: Config) -> Config:
    """Fill the algorithm preset into unset fields and check values and cross-field constraints."""
    for dotted, allowed in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value is not None and value not in allowed:
            raise ValueError(f"config key '{dotted}' = {value!r}; expected one of {', '.join(allowed)}")
    preset = PRESETS[cfg.algorithm.name]
    for key, value in preset.items():
        if getattr(cfg.algorithm, key) is None:
            setattr(cfg.algorithm, key, value)
    t = cfg.trainer
    if t.cpu_threads is None:
        t.cpu_threads = default_cpu_threads()
    positive = {"trainer.max_steps": t.max_steps, "trainer.rollout_batch_size": t.rollout_batch_size,
                "trainer.update_batch_size": t.update_batch_size, "trainer.micro_batch_size": t.micro_batch_size,
                "trainer.loss_workspace_mib": t.loss_workspace_mib,
                "rollout.n": cfg.rollout.n, "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
                "data.max_prompt_length": cfg.data.max_prompt_length}
    for key, value in positive.items():
        if value <= 0:
            raise ValueError(f"config key '{key}' must be > 0, got {value}")
    if t.rollout_batch_size % t.update_batch_size:
        raise ValueError(f"trainer.rollout_batch_size ({t.rollout_batch_size}) must be a multiple of "
                         f"trainer.update_batch_size ({t.update_batch_size})")
    if not 0 <= t.zero_stage <= 3:
        raise ValueError(f"trainer.zero_stage must be 0, 1, 2 or 3, got {t.zero_stage}")
    if t.offload_optimizer and t.zero_stage == 0:
        raise ValueError("trainer.offload_optimizer needs trainer.zero_stage >= 1, got 0")
    if t.offload_params and t.zero_stage != 3:
        raise ValueError(f"trainer.offload_params needs trainer.zero_stage=3, got {t.zero_stage}")
    if t.lr <= 0:
        raise ValueError(f"trainer.lr must be > 0, got {t.lr}")
    check_retention(t)
    resolve_rollout(cfg.rollout)
    if cfg.reward.weights is not None and len(cfg.reward.weights) != len(cfg.reward.functions):
        raise ValueError(f"reward.weights has {len(cfg.reward.weights)} entries but reward.functions has "
                         f"{len(cfg.reward.functions)}")
    if not cfg.reward.functions:
        raise ValueError("reward.functions is empty; give at least one reward function")
    check_lora(cfg.model.lora)
    a = cfg.algorithm
    check_qkl_coef(a.qkl_coef, "algorithm.qkl_coef")
    if a.policy_kl_coef < 0:
        raise ValueError("algorithm.policy_kl_coef must be >= 0")
    if a.advantage in ("grpo", "rloo") and cfg.rollout.n < 2:
        # a group of one response is its own baseline: every advantage would be 0 and the policy term learn nothing
        raise ValueError(f"algorithm.advantage '{a.advantage}' needs rollout.n >= 2 (a group of one response has "
                         "advantage 0); raise rollout.n or use algorithm.advantage=reinforce")
    a.loss_options = LossOptions(**{name: getattr(a, name) for name in CONFIG_LOSS_OPTIONS},
                                 temperature=cfg.rollout.temperature,
                                 rollout_is_cap=cfg.rollout.importance_sampling_cap)
    return cfg


def run_summary(cfg: Config) -> str:
    """One line on what a run does (`erpo train` adds where it writes the whole resolved config)."""
    t = cfg.trainer
    return (f"{cfg.algorithm.name} on {cfg.model.name_or_path}, data {cfg.data.source}, {t.max_steps} steps of "
            f"{t.rollout_batch_size} prompts x {cfg.rollout.n}, seed {t.seed}, {t.cpu_threads} CPU threads -> "
            f"{cfg.output_dir}")
