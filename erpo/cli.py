"""The `erpo` command line: train, precompute-ref, eval, plot.

    erpo train [--config FILE] [--output-dir DIR] [--max-steps N] [--algorithm NAME] [--seed S]
               [--zero-stage K] [--save-steps N] [--resume] [--set key=value ...]
    erpo precompute-ref [--config FILE] [--output-dir DIR] [--overwrite] [--set key=value ...]
    erpo eval ...   (erpo.evaluation)       erpo plot ...   (erpo.plotting)

`erpo train` with no --config runs the built-in tiny default (CPU, a few minutes).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib import resources

from erpo.config import PRESETS, Config, apply_overrides, dump_yaml, load_config, resolve

log = logging.getLogger("erpo")


def shipped_config(name: str) -> str:
    """Path of a config shipped in erpo/configs (name with or without .yaml)."""
    file = resources.files("erpo") / "configs" / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not file.is_file():
        available = sorted(p.name for p in (resources.files("erpo") / "configs").iterdir() if p.name.endswith(".yaml"))
        raise FileNotFoundError(f"--config {name}: no such file, and not a shipped config ({', '.join(available)})")
    return str(file)


def config_from_args(args) -> Config:
    """Config file (or the built-in default) + the dedicated flags + --set overrides, resolved."""
    path = args.config
    if path is not None and not os.path.exists(path):
        path = shipped_config(path)
    cfg = load_config(path)
    flags = []
    for flag, key in (("output_dir", "output_dir"), ("max_steps", "trainer.max_steps"),
                      ("algorithm", "algorithm.name"), ("seed", "trainer.seed"), ("zero_stage", "trainer.zero_stage"),
                      ("save_steps", "trainer.save_steps")):
        value = getattr(args, flag, None)
        if value is not None:
            flags.append(f"{key}={value}")
    apply_overrides(cfg, flags + list(args.set or []))
    return resolve(cfg)


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file, or the name of a shipped config (tiny, "
                                    "qwen25_math_7b_erpo, qwen25_math_7b_grpo, qwen25_math_7b_erpo_lora); default: the "
                                    "built-in tiny run")
    p.add_argument("--output-dir", help="run directory (config output_dir)")
    p.add_argument("--set", nargs="+", action="extend", metavar="KEY=VALUE", default=[],
                   help="override any config key, e.g. --set trainer.lr=1e-5 algorithm.qkl_coef=0.05")


def add_local_rank_argument(p: argparse.ArgumentParser) -> None:
    """`--local_rank=N`, which the deepspeed launcher inserts before the subcommand (unless --no_local_rank);
    main() exports it as LOCAL_RANK when the launcher did not. Absent from the namespace when not given."""
    p.add_argument("--local_rank", "--local-rank", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="erpo", description="ERPO: Environment-Regularized Policy Optimization")
    add_local_rank_argument(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a policy with ERPO (or a baseline)")
    add_config_arguments(train)
    train.add_argument("--max-steps", type=int, help="rollout steps (trainer.max_steps)")
    train.add_argument("--algorithm", choices=sorted(PRESETS), help="algorithm.name")
    train.add_argument("--seed", type=int, help="trainer.seed")
    train.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage (trainer.zero_stage)")
    train.add_argument("--save-steps", type=int, help="checkpoint every N rollout steps (trainer.save_steps)")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the output dir")
    add_local_rank_argument(train)

    pre = sub.add_parser("precompute-ref", help="cache ell_theta0(q) and w(q) for every training prompt")
    add_config_arguments(pre)
    pre.add_argument("--overwrite", action="store_true", help="rebuild the cache even if it exists")
    add_local_rank_argument(pre)

    evaluation = sub.add_parser("eval", help="evaluate models over temperatures (Avg@k, Pass@k)")
    plot = sub.add_parser("plot", help="plot training runs' metrics.jsonl")
    try:
        from erpo.evaluation import add_eval_arguments
        add_eval_arguments(evaluation)
    except ImportError as exc:
        evaluation.set_defaults(unavailable=f"erpo eval is unavailable: {exc}")
    try:
        from erpo.plotting import add_plot_arguments
        add_plot_arguments(plot)
    except ImportError as exc:
        plot.set_defaults(unavailable=f"erpo plot is unavailable: {exc}")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    args = build_parser().parse_args(argv)
    if hasattr(args, "local_rank"):
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    if getattr(args, "unavailable", None):
        print(args.unavailable, file=sys.stderr)
        return 2
    if args.command in ("train", "precompute-ref"):
        try:
            cfg = config_from_args(args)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            print(f"erpo {args.command}: config error: {exc}", file=sys.stderr)
            return 2
        print(f"# resolved config\n{dump_yaml(cfg)}", flush=True)
        from erpo import distributed, trainer
        try:
            if args.command == "train":
                trainer.train(cfg, resume=args.resume)
            else:
                _, path, _ = trainer.precompute_reference(cfg, overwrite=args.overwrite)
                print(path)
        finally:
            distributed.destroy_distributed()  # every rank, also after an error (a live group can abort at exit)
        return 0
    if args.command == "eval":
        from erpo.evaluation import run_eval
        run_eval(args)
        return 0
    from erpo.plotting import run_plot
    run_plot(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
