"""Options shared by `erpo` subcommands and the run config they build (a config file or the built-in default, the
dedicated flags, then `--set` overrides). Registering the options imports nothing heavy: the config module (torch,
the kernels) loads when a command builds its config."""
from __future__ import annotations

import argparse
import os
from importlib import resources
from typing import TYPE_CHECKING

from erpo.errors import MissingInputError, UserError

if TYPE_CHECKING:
    from erpo.config import Config


def shipped_config(name: str) -> str:
    """Path of a config shipped in erpo/configs (name with or without .yaml)."""
    file = resources.files("erpo") / "configs" / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not file.is_file():
        available = sorted(p.name for p in (resources.files("erpo") / "configs").iterdir() if p.name.endswith(".yaml"))
        raise MissingInputError(f"--config {name}: no such file, and not a shipped config ({', '.join(available)})")
    return str(file)


def config_from_args(args, overrides: tuple[str, ...] = ()) -> Config:
    """Config file (or the built-in default) + the dedicated flags + --set overrides + `overrides` (key=value, last
    wins), resolved. Any problem is a UserError with exit code 2 naming the key or file."""
    from erpo.config import apply_overrides, load_config, resolve
    try:
        path = args.config
        if path is not None and not os.path.exists(path):
            path = shipped_config(path)
        if path is not None and os.path.isdir(path):
            raise ValueError(f"--config {path}: is a directory; give a YAML file or a shipped config's name")
        cfg = load_config(path)
        flags = []
        for flag, key in (("output_dir", "output_dir"), ("max_steps", "trainer.max_steps"),
                          ("algorithm", "algorithm.name"), ("seed", "trainer.seed"),
                          ("zero_stage", "trainer.zero_stage"), ("save_steps", "trainer.save_steps")):
            value = getattr(args, flag, None)
            if value is not None:
                flags.append(f"{key}={value}")
        apply_overrides(cfg, flags + list(args.set or []) + list(overrides))
        return resolve(cfg)
    except (ValueError, TypeError, OSError) as exc:   # the config module's errors all name the key or file
        raise UserError(f"config error: {exc}", exit_code=2) from exc


def add_debug_argument(p: argparse.ArgumentParser, default=argparse.SUPPRESS) -> None:
    p.add_argument("--debug", action="store_true", default=default,
                   help="show the traceback of an error (also: ERPO_DEBUG=1)")


def add_config_arguments(p: argparse.ArgumentParser, output_help: str = "run directory (config output_dir)") -> None:
    p.add_argument("--config", help="YAML config file, or the name of a shipped config (tiny, "
                                    "qwen25_math_7b_erpo, qwen25_math_7b_grpo, qwen25_math_7b_erpo_lora); default: the "
                                    "built-in tiny run")
    p.add_argument("--output-dir", help=output_help)
    p.add_argument("--set", nargs="+", action="extend", metavar="KEY=VALUE", default=[],
                   help="override any config key, e.g. --set trainer.lr=1e-5 algorithm.qkl_coef=0.05")


def add_local_rank_argument(p: argparse.ArgumentParser) -> None:
    """`--local_rank=N`, which the deepspeed launcher inserts before the subcommand (unless --no_local_rank);
    main() exports it as LOCAL_RANK when the launcher did not. Absent from the namespace when not given."""
    p.add_argument("--local_rank", "--local-rank", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
