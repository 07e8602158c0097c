"""What the fused path's time depends on, in one short GPU run: its chunk rows and workspace, the trainer's
`host_layout`, and one group's GEMMs.

    python -m bench.fused_probe --shapes qwen2.5-7b,qwen2.5-32b --n 16384 --out DIR      # DIR/fused_probe.md
    TRITON_INTERPRET=1 python -m bench.fused_probe --smoke --out DIR                    # CPU, tiny: the dry run

Part 1, per shape: ours (`fused_linear_erpo_loss`, Triton) fwd+bwd on the bench's problem (bench.problem,
1024 rows a sample, a quarter of them query rows) under each variant of VARIANTS: the chunk rows beside the dlogits
store (`fused_linear_loss.LOGITS_ROWS`, set for the variant's calls), the workspace budget, the layout in host
memory as erpo's trainer passes it. Each row says how `plan_workspace` spent the budget (chunk rows, group rows).
A variant is 7 calls (2 warm-up, 5 timed) of about 93 ms (7b) and 133 ms (32b).

Part 2, per shape: one group's d hidden and d weight GEMMs (`--group-rows` rows of bf16 dlogits, the fused path's
calls: `mm` into d hidden, `addmm` into the fp32 [V, D] accumulator) one after the other on one stream, against
the two on two streams (d hidden on a side stream, joined by events), and d hidden split over the vocabulary into
4 GEMMs of one batched call (`baddbmm`-free: `bmm` then a sum): the d hidden GEMM has few output tiles ([G, D]) for
its long reduction, so part of its last wave idles. Two more d weight cases price the fp32 accumulator: written
with beta 0 (the first group's call: the accumulator is not read), and accumulated transposed ([D, V] += hidden^T @
dlogits, another cuBLAS kernel choice, which the backward's rounding pass could transpose back).

Timed as the bench times (bench/timing.py: CUDA events, warm-up, the median of `--repeats`); the numbers are for
choosing what to build, the bench is the measurement.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import NamedTuple, Optional

import torch

from .provenance import header_lines, provenance, write_report
from .timing import time_callable

GIB = 1 << 30


class Variant(NamedTuple):
    """One row of part 1: rows, LOGITS_ROWS (None: the library's); gib, the workspace (None: the library's);
    host_layout, the trainer's call."""

    name: str
    rows: Optional[int] = None
    gib: Optional[float] = None
    host_layout: bool = False


VARIANTS = (
    Variant("library default"),
    Variant("host layout (the trainer's call)", host_layout=True),
    Variant("chunk rows 384", rows=384),
    Variant("chunk rows 768", rows=768),
    Variant("chunk rows 1024", rows=1024),
    Variant("workspace 2 GiB", gib=2),
    Variant("workspace 4 GiB", gib=4),
)
SMOKE = {"shape": "32x128", "n": 32, "rows_per_sample": 16, "group_rows": 16, "gib": 1 / 4096, "repeats": 1}


@contextlib.contextmanager
def fused_knobs(variant: Variant):
    """`fused_linear_loss`'s probe knob (LOGITS_ROWS) set as `variant` says while the block runs, put back after
    it, also on an exception."""
    from erpo_kernels import fused_linear_loss
    names = ("LOGITS_ROWS",)
    saved = {name: getattr(fused_linear_loss, name) for name in names}
    values = (saved["LOGITS_ROWS"] if variant.rows is None else variant.rows,)
    try:
        for name, value in zip(names, values):
            setattr(fused_linear_loss, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(fused_linear_loss, name, value)


def fused_variants(problem, device, repeats: int, warmup: int, gib_unit: float) -> list:
    """[(variant, chunk rows, group rows, median ms, p20 ms, p80 ms)] of ours fwd+bwd on `problem`."""
    from erpo_kernels.fused_linear_loss import DEFAULT_WORKSPACE_BYTES, ROW_KERNELS, workspace_of

    from .contenders import erpo_fused_with_workspace

    layout = torch.stack((problem.token_kind, problem.sample_index)).long().cpu()
    out = []
    for variant in VARIANTS:
        budget = DEFAULT_WORKSPACE_BYTES if variant.gib is None else int(variant.gib * gib_unit * GIB)
        prepared = erpo_fused_with_workspace(budget, layout if variant.host_layout else None)(problem)  # the bench's

        def step():
            torch.autograd.grad(prepared.run(), prepared.inputs)

        with fused_knobs(variant):
            plan = workspace_of(problem.num_rows, problem.hidden, problem.weight, ROW_KERNELS["triton"], budget, False)
            timing = time_callable(step, device=device, warmup=warmup, reps=repeats)
        out.append((variant.name, plan.chunk_rows, plan.group_rows, timing.median_ms, timing.p20_ms, timing.p80_ms))
    return out


def one_and_two_streams(side_work, main_work, device):
    """(one_stream, two_streams): callables that run side_work then main_work on the current stream, and the two side
    by side, side_work on a side stream joined by events (on the CPU, the dry run, one stream both times)."""
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def one_stream():
        side_work()
        main_work()

    def two_streams():
        if side is None:  # the dry run: no streams on the CPU
            return one_stream()
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            side_work()
        main_work()
        torch.cuda.current_stream(device).wait_stream(side)

    return one_stream, two_streams


def group_gemms(shape, group_rows: int, device, repeats: int) -> list:
    """[(case, median ms)] of one group's d hidden and d weight GEMMs, on one stream, on two, d hidden split 4-way."""
    d, v = shape.hidden, shape.vocab
    dtype = torch.bfloat16
    hidden = torch.randn(group_rows, d, device=device, dtype=dtype)
    weight = torch.randn(v, d, device=device, dtype=dtype) * 0.02
    dlogits = torch.randn(group_rows, v, device=device, dtype=dtype)
    dhidden = torch.empty(group_rows, d, device=device, dtype=dtype)
    dweight = torch.zeros(v, d, device=device, dtype=torch.float32)
    dweight_t = torch.zeros(d, v, device=device, dtype=torch.float32)
    split = 4 if v % 4 == 0 else 1

    def d_hidden():
        torch.mm(dlogits, weight, out=dhidden)

    def d_weight(beta: float = 1.0):
        torch.addmm(dweight, dlogits.T, hidden, beta=beta, out_dtype=torch.float32, out=dweight)

    def d_weight_transposed():
        torch.addmm(dweight_t, hidden.T, dlogits, out_dtype=torch.float32, out=dweight_t)

    one_stream, two_streams = one_and_two_streams(d_hidden, d_weight, device)

    def d_hidden_split():
        parts = torch.bmm(dlogits.view(group_rows, split, v // split).transpose(0, 1),
                          weight.view(split, v // split, d), out_dtype=torch.float32)
        torch.sum(parts, dim=0, out=dhidden)

    cases = {"d hidden": d_hidden, "d weight += (fp32)": d_weight,
             "d weight = (fp32, beta 0: the accumulator not read)": lambda: d_weight(beta=0.0),
             "d weight^T += (fp32, a [D, V] accumulator)": d_weight_transposed, "both, one stream": one_stream,
             "both, two streams": two_streams, f"d hidden, {split} vocabulary slices (bmm, sum)": d_hidden_split}
    out = []
    for name, fn in cases.items():
        try:
            out.append((name, time_callable(fn, device=device, warmup=2, reps=repeats).median_ms))
        except (RuntimeError, TypeError) as error:  # an overload this torch lacks: say so, go on
            out.append((name, f"{type(error).__name__}: {str(error)[:80]}"))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.fused_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-32b")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--group-rows", type=int, default=2048, help="part 2's rows of dlogits (the 1 GiB group)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, Triton interpreter: a dry run")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD, if any)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from .problem import build_problem, parse_shape
    on_cuda = torch.cuda.is_available() and not args.smoke
    if not on_cuda and not args.smoke:
        raise SystemExit("bench.fused_probe: needs a CUDA device (or --smoke for the CPU dry run)")
    device = torch.device("cuda" if on_cuda else "cpu")
    shapes = [SMOKE["shape"]] if args.smoke else args.shapes.split(",")
    n, per_sample = (SMOKE["n"], SMOKE["rows_per_sample"]) if args.smoke else (args.n, 1024)
    group_rows = SMOKE["group_rows"] if args.smoke else args.group_rows
    repeats, warmup = (SMOKE["repeats"], 0) if args.smoke else (args.repeats, 2)
    name = torch.cuda.get_device_name() if on_cuda else "CPU dry run"
    lines = [f"# The fused path's variants ({name}, N={n}, bf16)", "",
             *header_lines(provenance("bench.fused_probe", sys.argv[1:] if argv is None else argv, args.commit)), ""]
    for spec in shapes:
        shape = parse_shape(spec)
        problem = build_problem("fused", shape, n, rows_per_sample=per_sample, query_frac=0.25,
                                dtype=torch.bfloat16, device=device, seed=0, chunk_rows=1024, clip_low=0.2,
                                clip_high=0.2)
        lines += [f"## {shape.name}: D={shape.hidden}, V={shape.vocab}", "",
                  "| variant | chunk rows | group rows | fwd+bwd ms (median) | p20 | p80 |",
                  "|---|---|---|---|---|---|"]
        for row in fused_variants(problem, device, repeats, warmup, SMOKE["gib"] if args.smoke else 1.0):
            lines.append("| {} | {} | {} | {:.2f} | {:.2f} | {:.2f} |".format(*row))
            print(lines[-1], flush=True)
        del problem
        if on_cuda:
            torch.cuda.empty_cache()
        lines += ["", f"One group's GEMMs, {group_rows} rows:", "", "| case | ms (median) |", "|---|---|"]
        for case, ms in group_gemms(shape, group_rows, device, repeats):
            lines.append(f"| {case} | {ms if isinstance(ms, str) else f'{ms:.3f}'} |")
            print(lines[-1], flush=True)
        lines.append("")
        if on_cuda:
            torch.cuda.empty_cache()
    write_report(args.out, "fused_probe.md", lines)


if __name__ == "__main__":
    main()
