"""Where a user's model name points: an existing local directory or a Hugging Face Hub `org/name`.

One check for every place that takes a model name from the user (`erpo eval --model`, the trainer's
`model.name_or_path` and `model.tokenizer`), so a mistyped local path fails at once with one line instead of
a minute of Hub retries and a traceback.
"""
from __future__ import annotations

import os
import re

from erpo.errors import UserError
from erpo.models.lora import ADAPTER_CONFIG

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")   # org/name
HUB_TIMEOUT_S = 5.0
# What a local directory holds to be loadable, by what is loaded from it: any one of the files (a model: its config,
# or a LoRA adapter's; a tokenizer: what `save_pretrained` writes, or the files of older ones)
HOLDS = {"model": ("config.json", ADAPTER_CONFIG),
         "tokenizer": ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")}


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set to a true value."""
    return any(os.environ.get(key, "").strip().lower() in ("1", "true", "yes", "on")
               for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _in_hub_cache(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache
    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def _hub_problem(name: str) -> str | None:
    """None when the Hub serves model `name`, else why not (one short clause); one request, no retries."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return None   # exists; loading it reports the missing access itself
    except RepositoryNotFoundError:
        return "no Hub model of that name (or it is private: log in with `hf auth login`)"
    except Exception as exc:  # noqa: BLE001  (any network failure: say it in one line)
        return f"the Hub cannot be reached ({type(exc).__name__}; set HF_HUB_OFFLINE=1 to work from the cache)"
    return None


def holds(directory: str, kind: str) -> bool:
    """Whether the local `directory` holds a `kind` ("model" or "tokenizer"): one of its HOLDS files."""
    return any(os.path.isfile(os.path.join(directory, file)) for file in HOLDS[kind])


def require(path: str, kind: str, option: str, fix: str) -> None:
    """A UserError when `path` is a local directory that holds no `kind` ("model" or "tokenizer", `holds`): one line
    naming `option` (the flag or config key the path came from) and the path, what the directory lacks, then `fix`
    (what to do). Nothing for a path that is no directory (a Hub name: its repository holds both)."""
    if os.path.isdir(path) and not holds(path, kind):
        raise UserError(f"{option} {path}: this directory holds no {kind} (none of {', '.join(HOLDS[kind])}); {fix}")


def resolve_model_source(name: str, option: str = "--model", kind: str = "model") -> str:
    """`name` when it is an existing local directory holding a `kind` ("model" or "tokenizer": one of its HOLDS
    files), or a Hub `org/name` that is in the local HF cache or that the Hub serves (checked with one request of at
    most HUB_TIMEOUT_S seconds, none when offline). Otherwise a UserError naming `option` (the flag or config key the
    name came from), saying what the local directory lacks, or that the local path does not exist and why the Hub
    cannot supply it."""
    if os.path.isdir(name):
        require(name, kind, option, f"give a directory that a {kind}'s save_pretrained wrote, or a Hub name org/name")
        return name
    if os.path.exists(name):
        raise UserError(f"{option} {name}: is a file; give a model directory or a Hub name org/name")
    missing = f"{option} {name}: no such local directory"
    if not HUB_NAME.match(name):
        raise UserError(f"{missing}, and not a Hub name (org/name); check the path")
    if _in_hub_cache(name):
        return name
    if hub_offline():
        raise UserError(f"{missing}, and the Hub is offline (HF_HUB_OFFLINE) with no cached model {name}; "
                        "check the path, or download the model while online")
    problem = _hub_problem(name)
    if problem:
        raise UserError(f"{missing}, and {problem}; check the path")
    return name
