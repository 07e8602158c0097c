"""`python -m bench`: check and time the contenders, write results.{md,json,png}. `--help` lists the options."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from .provenance import provenance

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SMOKE_ROWS = 64
SMOKE_ROWS_PER_SAMPLE = 16


def _csv(text: str) -> list:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shape on CPU (Triton interpreter), few reps: checks the harness, not speed")
    parser.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-32b",
                        help="comma list of lm_heads: qwen2.5-7b, qwen2.5-32b, or DxV (default: both Qwen2.5)")
    parser.add_argument("--n", default="4096,16384,65536", help="comma list of token-row counts N")
    parser.add_argument("--contenders", default="erpo,erpo-invariant,torch,compile,liger,cce",
                        help="comma list of: erpo, erpo-block, erpo-warp, erpo-warp-1024, erpo-log2, erpo-log2-2048 "
                             "(logits path: ours with one of the forward kernel's variants, "
                             "triton_logits.FORWARD_VARIANTS), erpo-ws2g (fused path: workspace_bytes=2 GiB), "
                             "erpo-dh32 (fused path: d hidden held in fp32), "
                             "erpo-epi (fused path: the forward row pass in the logits GEMM's epilogue), "
                             "erpo-geom-ROWS[-GROUP] (fused path: chunk rows, group rows, e.g. erpo-geom-256-2304), "
                             "erpo-invariant (fused path: batch_invariant=True), "
                             "torch, compile, liger, cce (default: erpo, erpo-invariant, torch, compile, liger, cce)")
    parser.add_argument("--skip", default="",
                        help="comma list of contenders to leave out of --contenders (e.g. torch: the slow reference)")
    parser.add_argument("--paths", default="logits,fused", help="comma list of: logits, fused (default: both)")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs before timing")
    parser.add_argument("--out", default=None,
                        help="directory for results.{md,json,png} (default: bench/results; --smoke: a new temp dir)")
    parser.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="logits / hidden / weight dtype")
    parser.add_argument("--rows-per-sample", type=int, default=1024, help="rows per sample (query + response)")
    parser.add_argument("--query-frac", type=float, default=0.25, help="fraction of each sample's rows that are query")
    parser.add_argument("--check-rows", type=int, default=4096,
                        help="rows per block of the fp32 reference in the correctness check")
    parser.add_argument("--budget", type=float, default=10.0,
                        help="seconds per timed measurement at most: fewer warm-ups and reps (>= 3) for slow cases")
    parser.add_argument("--merge", nargs="+", metavar="RUN", default=None,
                        help="no run: merge earlier runs into --out: each RUN a directory holding results.json or a "
                             "--progress file (JSON lines, possibly of several runs, kept rows of a stopped run)")
    parser.add_argument("--progress", default=None, metavar="FILE",
                        help="also append the run as JSON lines to FILE, each floor and row as soon as it is measured")
    parser.add_argument("--time-wrong", action="store_true", help="also time contenders whose check failed")
    parser.add_argument("--plan", action="store_true",
                        help="no run: check the arguments and print the rows the run would measure, one a line")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD, if any)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes = "smoke"
        args.n = str(SMOKE_ROWS)
        args.rows_per_sample = SMOKE_ROWS_PER_SAMPLE
        args.device = args.device or "cpu"
        args.reps = 1  # smoke times are not measurements
        args.warmup = 0  # the correctness check has already run every contender once (compiled, autotuned)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def _out_dir(args) -> Path:
    """Where the results go: --out, else bench/results, or for --smoke (no measurement: kept out of the repository
    unless asked) a new temporary folder, made here, when there are results to write: a --plan, or a run stopped
    by a wrong argument, leaves none behind."""
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="erpo-bench-smoke-") if args.smoke else "bench/results"
    return Path(args.out)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _load_runs(source) -> list:
    """The result sets in `source`: a run directory's results.json, or every run of a --progress file."""
    from .progress import read_runs

    source = Path(source)
    if source.is_dir():
        return [json.loads((source / "results.json").read_text())]
    if not source.is_file():
        raise SystemExit(f"--merge: {source} is neither a run directory nor a --progress file")
    return read_runs(source)


def _merged_peers(parts: list) -> dict:
    """Every run's peer versions (a peer missing in one run may be installed in another); a version clash is an
    error."""
    peers = {}
    for part in parts:
        for name, version in part["meta"].get("peers", {}).items():
            if version is not None and peers.get(name) not in (None, version):
                raise SystemExit(f"--merge: runs differ in the version of {name}: {peers[name]} and {version}")
            peers[name] = peers.get(name) or version
    return peers


def merge(sources, out: Path) -> dict:
    """One result set from several runs (directories or --progress files): rows concatenated, the first floor of each
    case kept, ratios recomputed; the runs must share device, commit, torch, triton and dtype."""
    from .report import add_ratios, write_outputs

    parts = [run for source in sources for run in _load_runs(source)]
    if not parts:
        raise SystemExit(f"--merge: no run found in {list(map(str, sources))}")
    meta = dict(parts[0]["meta"])
    for key in ("device", "commit", "torch", "triton", "dtype"):
        values = sorted({str(p["meta"].get(key)) for p in parts})
        if len(values) > 1:
            raise SystemExit(f"--merge: runs differ in {key}: {values}")
    for key in meta.keys() - {"device", "commit", "torch", "triton", "dtype", "date", "command", "peers"}:
        values = list(dict.fromkeys(str(p["meta"].get(key)) for p in parts))
        if len(values) > 1:
            meta[key] = " / ".join(values)
    meta["date"] = " / ".join(p["meta"]["date"] for p in parts)
    meta["command"] = " ; ".join(p["meta"]["command"] for p in parts)
    meta["peers"] = _merged_peers(parts)
    floors = {}
    for floor in (f for p in parts for f in p["floors"]):
        floors.setdefault((floor["path"], floor["shape"], floor["N"]), floor)
    results = {"meta": meta, "floors": list(floors.values()), "rows": [r for p in parts for r in p["rows"]]}
    add_ratios(results)
    return write_outputs(results, out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.merge:
        files = merge(args.merge, _out_dir(args))
        print(files["md"].read_text())
        print("wrote " + ", ".join(str(p) for p in files.values()))
        return 0
    device = torch.device(args.device)
    if device.type == "cpu":  # before any Triton kernel is defined (erpo_kernels, Liger and CCE import lazily)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.smoke:
        torch.set_num_threads(1)  # CI boxes are small and shared: one thread is steadier than oversubscribed ones

    from .contenders import check_keys, select
    from .problem import SMOKE_SHAPE, parse_shape
    from .progress import ProgressWriter
    from .report import add_ratios, write_outputs
    from .run import BenchConfig, planned_rows, run_benchmark

    shapes = [SMOKE_SHAPE] if args.smoke else [parse_shape(s) for s in _csv(args.shapes)]
    paths = _csv(args.paths)
    if not set(paths) <= {"logits", "fused"} or not paths:
        raise SystemExit(f"--paths: expected a comma list of logits, fused; got {args.paths!r}")
    try:
        ns = [int(n) for n in _csv(args.n)]
    except ValueError:
        raise SystemExit(f"--n: expected a comma list of integers, got {args.n!r}")
    skipped = _csv(args.skip)
    try:
        check_keys(skipped, "--skip")
        contenders = select([key for key in _csv(args.contenders) if key not in skipped], paths)
    except ValueError as error:  # an unknown or malformed --skip / --contenders name: the user's, one line
        raise SystemExit(str(error))
    config = BenchConfig(shapes=shapes, ns=ns, paths=paths, contenders=contenders, device=device,
                         dtype=DTYPES[args.dtype], reps=args.reps, warmup=args.warmup,
                         rows_per_sample=args.rows_per_sample, query_frac=args.query_frac,
                         check_rows=args.check_rows, budget_s=args.budget, time_wrong=args.time_wrong,
                         seed=args.seed)
    if args.plan:
        rows = planned_rows(config)
        print("".join(f"plan: {row['path']} {row['shape']} N={row['N']} {row['contender']}\n" for row in rows)
              + f"{len(rows)} rows planned, none run (--plan)")
        return 0
    meta = {
        "device": _device_name(device), **provenance("bench", argv, args.commit), "cuda": torch.version.cuda,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1", "dtype": args.dtype, "reps": args.reps,
        "warmup": args.warmup, "budget_s": args.budget, "rows_per_sample": args.rows_per_sample,
        "query_frac": args.query_frac, "peers": {c.distribution: c.version() for c in contenders if c.distribution},
    }
    print(f"bench: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}",
          flush=True)
    progress = ProgressWriter(Path(args.progress)) if args.progress else None
    if progress:
        progress.write("meta", meta)
        progress.write("plan", planned_rows(config))
    try:
        results = {"meta": meta, **run_benchmark(config, log=lambda text: print(text, flush=True),
                                                 record=progress.write if progress else None)}
    finally:
        if progress:
            progress.close()
    add_ratios(results)
    files = write_outputs(results, _out_dir(args))
    print(files["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in files.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
