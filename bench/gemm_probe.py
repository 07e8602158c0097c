"""The fused path's GEMMs alone, per row chunk, on the GPU: what a chunk of `rows` rows costs in cuBLAS before any
of our kernels run, so that the fused path's time can be split into GEMMs, row kernels and the rest.

    python -m bench.gemm_probe --shape qwen2.5-7b --rows 512,1024,2048,4096 --n 16384 --out DIR   # DIR/gemm_probe.md

Per row count, each timed alone (CUDA events, median of `--repeats`) and scaled to N rows (N / rows GEMMs):
logits = hidden_c @ W.T with fp32 output and with bf16 output (a chunk's logits: 512 rows is the fused path's
chunk beside a dlogits store, fused_linear_loss.LOGITS_ROWS); d hidden = dlogits_g @ W; d weight accumulated into an
fp32 [V, D] buffer (addmm, beta=1: reads and writes 4 V D bytes per group) and, for comparison, formed into bf16 with
no accumulation (a group's GEMMs: 2048 rows in the default 1 GiB for bf16 Qwen2.5-7B). dlogits are a dense bf16
[rows, V] tensor, as the store holds them. TFLOP/s is 2 rows D V per GEMM over its time. Timed as the bench
times (bench/timing.py: CUDA events, one warm-up call, the median of `--repeats`).
"""
from __future__ import annotations

import argparse
import sys

import torch

from .provenance import header_lines, provenance, write_report
from .timing import time_callable


def probe(shape, rows: int, total_rows: int, repeats: int) -> list:
    """[(name, ms per chunk, ms for total_rows, TFLOP/s)] for one chunk size."""
    device = torch.device("cuda")
    d, v = shape.hidden, shape.vocab
    hidden = torch.randn(rows, d, device=device, dtype=torch.bfloat16)
    weight = torch.randn(v, d, device=device, dtype=torch.bfloat16) * 0.02
    logits32 = torch.empty(rows, v, device=device, dtype=torch.float32)
    logits16 = torch.empty(rows, v, device=device, dtype=torch.bfloat16)
    dlogits = torch.randn(rows, v, device=device, dtype=torch.bfloat16)  # as the fused path's dlogits store
    dhidden = torch.empty(rows, d, device=device, dtype=torch.bfloat16)
    dweight32 = torch.zeros(v, d, device=device, dtype=torch.float32)
    dweight16 = torch.empty(v, d, device=device, dtype=torch.bfloat16)
    cases = {
        "logits, fp32 out": lambda: torch.mm(hidden, weight.T, out_dtype=torch.float32, out=logits32),
        "logits, bf16 out": lambda: torch.mm(hidden, weight.T, out=logits16),
        "d hidden, bf16 out": lambda: torch.mm(dlogits, weight, out=dhidden),
        "d weight += (fp32 accumulator)": lambda: torch.addmm(dweight32, dlogits.T, hidden, out_dtype=torch.float32,
                                                              out=dweight32),
        "d weight, bf16 out, no accumulation": lambda: torch.mm(dlogits.T, hidden, out=dweight16),
    }
    chunks = total_rows / rows
    flops = 2 * rows * d * v
    out = []
    for name, fn in cases.items():
        try:
            ms = time_callable(fn, device=device, warmup=1, reps=repeats).median_ms
        except Exception as error:  # an op this torch lacks: say so, go on
            out.append((name, float("nan"), float("nan"), f"{type(error).__name__}: {str(error)[:80]}"))
            continue
        out.append((name, ms, ms * chunks, f"{flops / ms / 1e9:.0f}"))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.gemm_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-7b")
    parser.add_argument("--rows", default="512,1024,2048,4096")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD, if any)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.gemm_probe: needs a CUDA device (it times cuBLAS)")
    from .problem import parse_shape
    shape = parse_shape(args.shape)
    lines = [f"# The fused path's GEMMs per row chunk ({torch.cuda.get_device_name()}, {shape.name}: D={shape.hidden}, "
             f"V={shape.vocab}, bf16 inputs, N={args.n})", "",
             *header_lines(provenance("bench.gemm_probe", sys.argv[1:] if argv is None else argv, args.commit)), "",
             "| rows per chunk | GEMM | ms per chunk | ms for N rows | TFLOP/s |", "|---|---|---|---|---|"]
    for rows in [int(r) for r in args.rows.split(",")]:
        torch.cuda.empty_cache()  # the last size's buffers, freed when probe returned
        for name, ms, total, rate in probe(shape, rows, args.n, args.repeats):
            lines.append(f"| {rows} | {name} | {ms:.3f} | {total:.2f} | {rate} |")
            print(lines[-1], flush=True)
    write_report(args.out, "gemm_probe.md", lines)


if __name__ == "__main__":
    main()
