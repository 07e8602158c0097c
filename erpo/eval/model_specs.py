"""Which models `erpo eval` compares and how each is prompted: `--model` specs (a model dir, a Hub name, a training
run, one of its checkpoints, the model a run started from, or a run's whole history) resolved to `ModelSpec`s, and
each model's prompt settings (the run's own template, or `--template`)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from erpo.config import load_config
from erpo.eval.defaults import DEFAULT_MAX_NEW_TOKENS
from erpo.manifest import CHECKPOINTS_DIR, complete_checkpoints, require_intact
from erpo.models.export import HF_DIR
from erpo.models.loading import model_path_for
from erpo.models.source import holds, require, resolve_model_source
from erpo.tasks.data import TEMPLATES

# Prompt templates that are whole prompts (no chat template around them), by name. "qwen-math": Dr.GRPO's
# evaluation prompt for base models (its apply_qwen_math_template), which the paper's base-model numbers follow.
RAW_TEMPLATES = {
    "qwen-math": ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
                  "<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"),
}


@dataclasses.dataclass
class ModelSpec:
    """A model to evaluate: table label, path or Hub name to load, and the run dir it came from; for one model of a
    run's history (`RUN_DIR@all`), that history's label and the training step (rollout steps; 0: the start)."""

    label: str
    path: str
    run_dir: str | None = None
    history: str | None = None
    step: int | None = None


RUN_START_SUFFIX = "@start"
RUN_HISTORY_SUFFIX = "@all"


def _is_run_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.yaml"))


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "meta.json"))


def resolve_checkpoint(target: str, label: str) -> ModelSpec:
    """A training checkpoint (``RUN_DIR/checkpoints/step-N``): its Hugging Face export ``hf/``, with the run's
    prompt settings; labelled ``RUN@step-N`` unless ``label`` is given."""
    model = os.path.join(target, HF_DIR)
    require_intact(target, only=f"{HF_DIR}/")   # its manifest: sizes and digests of hf/'s files
    if not holds(model, "model"):
        raise ValueError(f"--model {target}: this checkpoint holds no Hugging Face export ({HF_DIR}/config.json): "
                         "it was saved with trainer.save_hf=false or by an older erpo; evaluate a checkpoint saved "
                         "with trainer.save_hf=true, or the run's final/ model")
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(target)))
    run_dir = run_dir if _is_run_dir(run_dir) else None
    step = os.path.basename(os.path.abspath(target))
    name = label or (f"{os.path.basename(run_dir)}@{step}" if run_dir else step)
    return ModelSpec(name, model, run_dir)


def load_run_config(run_dir: str):
    """The resolved ``erpo.config.Config`` a training run was started with (``RUN_DIR/config.yaml``)."""

    return load_config(os.path.join(run_dir, "config.yaml"))


def run_start_model(run_dir: str) -> str:
    """Path or Hub name of the pre-RL model a run started from (for the tiny default: its SFT warm start)."""

    return model_path_for(load_run_config(run_dir))


def split_spec(spec: str) -> tuple[str, str]:
    """``[LABEL=]TARGET`` -> (label or "", target without a trailing slash)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--model must be a non-empty path or name, got {spec!r}")
    label, eq, target = spec.strip().partition("=")
    if not eq:
        label, target = "", label
    return label, target.rstrip("/") or target


def run_dir_of(target: str, suffix: str) -> str:
    """The training output dir of ``RUN_DIR@start`` / ``RUN_DIR@all``; ValueError when it is none."""
    run_dir = target[: -len(suffix)].rstrip("/")
    if not _is_run_dir(run_dir):
        raise ValueError(f"--model {target}: {run_dir} is not a training output dir (no config.yaml)")
    return run_dir


def resolve_history(spec: str) -> list[ModelSpec]:
    """``[LABEL=]RUN_DIR@all``: the model the run started from (step 0, labelled ``LABEL@start``) and each of its
    complete checkpoints (``LABEL@step-N``, their ``hf/`` exports), sorted by step; LABEL defaults to the run dir's
    name. Which checkpoints a run keeps: trainer.keep_last and trainer.keep_every."""
    label, target = split_spec(spec)
    run_dir = run_dir_of(target, RUN_HISTORY_SUFFIX)
    name = label or os.path.basename(os.path.abspath(run_dir))
    checkpoints = complete_checkpoints(Path(run_dir) / CHECKPOINTS_DIR)
    if not checkpoints:
        raise ValueError(f"--model {target}: {run_dir} holds no complete checkpoint (checkpoints/step-N); train "
                         "with trainer.save_steps > 0 (and trainer.keep_every to keep its history)")
    history = [] if checkpoints[0][0] == 0 else [   # a step-0 checkpoint holds the start model itself
        ModelSpec(name + RUN_START_SUFFIX, run_start_model(run_dir), run_dir, name, 0)]
    for step, path in checkpoints:
        model = resolve_checkpoint(str(path), f"{name}@step-{step}")
        history.append(dataclasses.replace(model, history=name, step=step))
    return history


def resolve_model(spec: str) -> ModelSpec:
    """Resolve ``[LABEL=]TARGET``. TARGET is an HF model dir, a Hub name, a training output dir (its
    ``final/`` model), a checkpoint dir of one (``RUN_DIR/checkpoints/step-N``, its ``hf/`` model) or
    ``RUN_DIR@start`` (the model that run started from, before RL)."""
    label, target = split_spec(spec)
    if target.endswith(RUN_START_SUFFIX):
        run_dir = run_dir_of(target, RUN_START_SUFFIX)
        name = label or os.path.basename(os.path.abspath(run_dir)) + RUN_START_SUFFIX
        return ModelSpec(name, run_start_model(run_dir), run_dir)
    if os.path.isdir(target):
        name = label or os.path.basename(os.path.abspath(target))
        final = os.path.join(target, "final")
        if holds(final, "model"):
            return ModelSpec(name, final, target if _is_run_dir(target) else None)
        if holds(target, "model"):
            return ModelSpec(name, target, None)
        if _is_checkpoint_dir(target):
            return resolve_checkpoint(target, label)
        raise ValueError(
            f"--model {target}: neither an HF model dir (config.json), a finished training run "
            f"(final/config.json) nor a checkpoint (meta.json); for an unfinished run pass one of its "
            f"checkpoints (RUN_DIR/checkpoints/step-N)"
        )

    return ModelSpec(label or target.replace("/", "--"), resolve_model_source(target, "--model"), None)


def parse_models(values: list[str]) -> list[ModelSpec]:
    """``--model`` values (repeatable, each comma-separated) -> unique ModelSpecs (``RUN_DIR@all``: several)."""
    items = [item for value in values for item in value.split(",") if item.strip()]
    specs = [model for item in items
             for model in (resolve_history(item) if split_spec(item)[1].endswith(RUN_HISTORY_SUFFIX)
                           else [resolve_model(item)])]
    if not specs:
        raise ValueError("--model: give at least one model")
    for spec in specs:   # evaluation loads each model's tokenizer from its directory (a Hub model's holds one)
        require(spec.path, "tokenizer", "--model", "save the model's tokenizer there")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--model labels must be unique, got {labels}; name them LABEL=PATH")
    return specs


@dataclasses.dataclass
class PromptSettings:
    """How prompts are rendered and how long answers may be; a run's own settings by default."""

    template: str = "paper"
    use_chat_template: bool = True
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS


def prompt_settings(model: ModelSpec, template: str | None, max_new_tokens: int) -> PromptSettings:
    """Settings for one model: `template` (a name of RAW_TEMPLATES, "paper", "plain" or a format string), else
    its training run's prompt format, else the paper's; `max_new_tokens` is the comparison's single budget."""
    settings = PromptSettings(max_new_tokens=max_new_tokens)
    if model.run_dir is not None:
        cfg = load_run_config(model.run_dir)
        settings.template, settings.use_chat_template = cfg.data.template, cfg.data.use_chat_template
    if template in RAW_TEMPLATES:
        settings.template, settings.use_chat_template = RAW_TEMPLATES[template], False
    elif template is not None:
        settings.template = template
    return settings


def parse_templates(values: list[str] | None, labels: list[str]) -> dict[str, str]:
    """``--template`` values -> {model label: template}. ``LABEL=TEMPLATE`` sets one model's template (LABEL one
    of `labels`), a value without a known label prefix sets the template of every model not named. A template that
    is no name and holds no {problem} (say a mistyped LABEL=) is a ValueError here, before any model loads."""
    per_model, every = {}, None
    for value in values or []:
        label, eq, template = value.partition("=")
        for_one_model = bool(eq) and label in labels
        template = template if for_one_model else value
        if template not in RAW_TEMPLATES and template not in TEMPLATES and "{problem}" not in template:
            raise ValueError(f"--template {value}: not a template name ({', '.join([*TEMPLATES, *RAW_TEMPLATES])}) "
                             f"and no {{problem}} in it; for one model write LABEL=TEMPLATE, LABEL one of "
                             f"{', '.join(labels)}")
        if for_one_model:
            per_model[label] = template
        elif every is None:
            every = value
        else:
            raise ValueError(f"--template: two templates for every model ({every!r}, {value!r}); prefix one with "
                             f"a model label ({', '.join(labels)}) as LABEL=TEMPLATE")
    return {label: per_model.get(label, every) for label in labels if per_model.get(label, every) is not None}
