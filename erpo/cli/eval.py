"""`erpo eval`: its options and entry point (the evaluation itself is erpo.eval.evaluate, which with torch and the
models loads when the command runs: the parser needs only erpo.eval.defaults)."""
from __future__ import annotations

import argparse
import sys

from erpo.errors import UserError
from erpo.eval.defaults import DEFAULT_K, DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURES, TEMPERATURE_GRIDS

# the keywords of `evaluate` and the functions it calls -> the options they come from, which their errors name
OPTION_NAMES = {"k": "--k", "temperatures": "--temperatures", "pass_ks": "--pass-k", "batch_size": "--batch-size",
                "top_p": "--top-p", "gpu_memory_utilization": "--gpu-memory-utilization", "model_path": "--model",
                "engine": "--engine", "tensor_parallel_size": "--tensor-parallel-size"}


def _numbers(text: str, name: str, kind: type) -> list:
    """Comma-separated values of `kind` (int or float) of the option `name`; ValueError naming it."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        what = "integers" if kind is int else "numbers"
        raise ValueError(f"{name} must be comma-separated {what}, got {text!r}") from err
    if not values:
        raise ValueError(f"{name} must hold at least one value")
    return values


def parse_temperatures(text: str, name: str) -> list[float]:
    """A named grid of TEMPERATURE_GRIDS or comma-separated temperatures (the option `name`'s value)."""
    return list(TEMPERATURE_GRIDS.get(text, ())) or _numbers(text, name, float)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``erpo eval`` options on a (sub)parser."""
    parser.add_argument("--model", action="append", required=True, metavar="[LABEL=]PATH_OR_RUN_DIR",
                        help="HF model dir, Hub name, training output dir (its final/ model), one of its "
                             "checkpoints (RUN_DIR/checkpoints/step-N), RUN_DIR@start (the model the run started "
                             "from) or RUN_DIR@all (the run's history: its start and every kept checkpoint, also "
                             "tabulated step x temperature in history.md and drawn in accuracy_over_steps.png); "
                             "repeatable or comma-separated to compare models")
    parser.add_argument("--benchmarks", default="synthetic",
                        help="comma-separated benchmark specs [NAME=]SOURCE[#problem=F#answer=F#split=S#limit=N]; "
                             "SOURCE: synthetic (default, offline), heldout (arithmetic beyond the training operands, "
                             "offline), a .jsonl/.json/.parquet file, "
                             "math500/aime24/aime25/amc/minerva/olympiadbench or owner/name on the Hub")
    parser.add_argument("--temperatures", default=DEFAULT_TEMPERATURES,
                        help="comma-separated sampling temperatures, or a named grid: "
                             + "; ".join(f"{name} = {','.join(f'{t:g}' for t in grid)}"
                                         for name, grid in TEMPERATURE_GRIDS.items()) + " (default: %(default)s)")
    parser.add_argument("--k", type=int, default=DEFAULT_K, help="samples per problem (default: %(default)s)")
    parser.add_argument("--pass-k", default=None,
                        help="comma-separated k values for Pass@k (default: powers of two up to --k)")
    parser.add_argument("--output-dir", default="eval_results", help="results and sample cache (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help="response budget of every model of the comparison (default: %(default)s, Dr.GRPO's)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="base sampling seed (default: %(default)s)")
    parser.add_argument("--template", action="append", default=None, metavar="[LABEL=]TEMPLATE",
                        help="prompt template: paper, plain, qwen-math (Dr.GRPO's base-model prompt, no chat "
                             "template) or a string with {problem}; LABEL=TEMPLATE for one model (repeatable); "
                             "default: a run's own, else the paper's")
    parser.add_argument("--engine", choices=("auto", "hf", "vllm"), default="auto",
                        help="rollout engine (as the trainer's rollout.engine); auto = vLLM when installed, "
                             "else HF generate")
    parser.add_argument("--backend", dest="deprecated_backend", choices=("auto", "hf", "vllm"), default=None,
                        help=argparse.SUPPRESS)   # the old name of --engine, accepted with a deprecation line
    parser.add_argument("--device", default=None, help="torch device for HF generate (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="vLLM only: fraction of the GPU it may take (default: %(default)s)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="vLLM only: GPUs each model is sharded over, for models too large for one GPU "
                             "(default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def generate_device(name: str | None) -> str:
    """The torch device HF generate runs on: `name` (--device), else cuda when this machine has it, else cpu. A name
    torch does not know, or a CUDA device on a machine without one, is a ValueError naming --device (checked before
    any model loads, not as torch's assertion deep inside generate)."""
    import torch
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(name).type
    except RuntimeError as exc:
        raise ValueError(f"--device {name}: not a torch device ({exc}); e.g. cpu, cuda or cuda:1") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this machine has no CUDA device (torch.cuda.is_available() is False); "
                         "leave --device out or give --device cpu")
    return name


def run_eval(args: argparse.Namespace) -> None:
    """Entry point of ``erpo eval``: evaluate, write the results, print the markdown tables and the files' paths.

    Bad arguments or inputs are a UserError: ``erpo eval: <message>`` (status 1), the traceback with --debug.
    """
    # before the checks below, which make an ImportError a UserError: a missing package of the trainer's extra is
    # the `erpo` command's line (what to install)
    from erpo.eval.evaluate import check_eval_arguments, evaluate
    from erpo.eval.model_specs import parse_models, parse_templates
    from erpo.eval.problem_sets import load_benchmarks
    from erpo.storage_errors import file_in_the_way

    if args.deprecated_backend is not None:
        print("erpo eval: --backend is deprecated, use --engine (same values)", file=sys.stderr)
        args.engine = args.deprecated_backend
    try:
        models = parse_models(args.model)
        benchmarks = load_benchmarks([s for s in args.benchmarks.split(",") if s.strip()])
        pass_ks = _numbers(args.pass_k, "--pass-k", int) if args.pass_k else None
        temperatures = parse_temperatures(args.temperatures, "--temperatures")
        templates = parse_templates(args.template, [m.label for m in models])
        for option, value in (("--max-new-tokens", args.max_new_tokens),
                              ("--tensor-parallel-size", args.tensor_parallel_size)):
            if value < 1:
                raise ValueError(f"{option} must be an integer >= 1, got {value}")
        check_eval_arguments(k=args.k, temperatures=temperatures, pass_ks=pass_ks, batch_size=args.batch_size,
                             top_p=args.top_p, gpu_memory_utilization=args.gpu_memory_utilization,
                             names=OPTION_NAMES)
        device = generate_device(args.device)
        blocking = file_in_the_way(args.output_dir)
        if blocking is not None:
            raise ValueError(f"--output-dir {args.output_dir}: {blocking} is a file, not a directory; give the "
                             "directory for the results and the sample cache")
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise UserError(str(exc)) from exc
    result = evaluate(models, benchmarks, temperatures=temperatures, k=args.k,
                      output_dir=args.output_dir, pass_ks=pass_ks, top_p=args.top_p,
                      max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                      templates=templates, engine=args.engine, device=device, dtype=args.dtype,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      tensor_parallel_size=args.tensor_parallel_size, progress=not args.no_progress,
                      names=OPTION_NAMES)
    for table in ("md", "history_md"):   # the history table too, when some --model is RUN_DIR@all
        if table in result["paths"]:
            with open(result["paths"][table], encoding="utf-8") as handle:
                print(handle.read())
    for path in result["paths"].values():
        print(path)
