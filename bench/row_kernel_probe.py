"""The logits kernels' forward alone, per variant (erpo_kernels.triton_logits.FORWARD_VARIANTS), on the GPU: what one
launch over [rows, V] logits costs, for the shapes the two paths launch (the logits path: all N rows in bf16; the
fused path: one chunk of fp32 logits), so that a variant can be chosen per path.

    python -m bench.row_kernel_probe --shapes bf16:4096,fp32:512 --out DIR   # DIR/row_kernel_probe.md

Times: triton.testing.do_bench's median (ms); GB/s is the logits' bytes read over that time.
"""
from __future__ import annotations

import argparse
import sys

import torch

from .provenance import header_lines, provenance, write_report

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.row_kernel_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="bf16:4096,bf16:16384,fp32:512,fp32:1024",
                        help="comma list of dtype:rows")
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD, if any)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.row_kernel_probe: needs a CUDA device (it times compiled Triton kernels)")
    import triton

    from erpo_kernels.triton_logits import FORWARD_VARIANTS, _launch_forward, forward_variant
    from erpo_kernels.validation import LogitTransform

    transform = LogitTransform(1.0, 1.0, None)
    lines = [f"# The logits kernels' forward alone ({torch.cuda.get_device_name()}, V={args.vocab})", "",
             *header_lines(provenance("bench.row_kernel_probe", sys.argv[1:] if argv is None else argv, args.commit)),
             "",
             "| dtype | rows | variant | ms | GB/s |", "|---|---|---|---|---|"]
    for spec in args.shapes.split(","):
        dtype_name, rows = spec.split(":")
        rows = int(rows)
        logits = torch.randn(rows, args.vocab, device="cuda", dtype=DTYPES[dtype_name])
        targets = torch.randint(0, args.vocab, (rows,), device="cuda")
        for name in FORWARD_VARIANTS:
            with forward_variant(name):
                ms = triton.testing.do_bench(lambda x=logits, t=targets: _launch_forward(x, t, transform))
            lines.append(f"| {dtype_name} | {rows} | {name} | {ms:.4f} | "
                         f"{logits.numel() * logits.element_size() / ms / 1e6:.0f} |")
            print(lines[-1], flush=True)
        del logits, targets
        torch.cuda.empty_cache()
    write_report(args.out, "row_kernel_probe.md", lines)


if __name__ == "__main__":
    main()
