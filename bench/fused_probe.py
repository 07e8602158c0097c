"""Which group geometry makes the fused path fastest in its workspace, in one short GPU run: its chunk rows, its
group rows and workspace, the trainer's `host_layout`, and one group's GEMMs at each group size.

    python -m bench.fused_probe --shapes qwen2.5-7b,qwen2.5-32b --n 16384 --out DIR      # DIR/fused_probe.md, .json
    TRITON_INTERPRET=1 python -m bench.fused_probe --smoke --out DIR                    # CPU, tiny: the dry run

Part 1, per shape: ours (`fused_linear_erpo_loss`, Triton) fwd+bwd on the bench's problem (bench.problem, 1024 rows
a sample, a quarter of them query rows) under each variant of VARIANTS: the chunk rows beside the dlogits store
(`fused_linear_loss.LOGITS_ROWS`) and a cap on the store's rows (`fused_linear_loss.GROUP_ROWS`, whole chunks), both
set for the variant's calls (bench.geometry.fused_knobs), the workspace budget, the layout in host memory as erpo's
trainer passes it; fused_probe.json holds these rows for bench.probe_pick, which picks the geometry gpu_check's
bench 1 times beside torch.compile. Each row says how `plan_workspace` spent the budget (chunk rows, group rows).
The question: which group geometry is fastest at the 1 GiB default. In the H200 run of 2026-11-27 bigger groups
helped (2 GiB's groups of 5632 rows: 90.0 ms against the default's 93.2 at 7b; 256-row chunks with groups of 2304
beat 512-row ones with 1024 in the pipelined loop since dropped), but 384-row chunks with groups of 2688 were slower
(94.5 ms): in 1 GiB, chunk rows 256 give groups of 2816 and 384 give 2688 (7b) or 2304 (32b), and the capped
variants hold the group at 2304 beside 256- or 384-row chunks and at 1536 beside the default's 512
(bench/RESULTS.md, the H200 lease of 2026-11-27). A variant is 7 calls (2 warm-up, 5 timed) of about 93 ms (7b) and
133 ms (32b).

Part 2, per shape: one group's d hidden GEMM ([G, V] x [V, D] into [G, D], `fused_linear_loss.write_grad_hidden`)
with bf16 output (the library's default) and with fp32 output (`GRAD_HIDDEN_FP32`, issue 32: cuBLAS may pick
another kernel for it, and it writes twice the bytes), and d weight accumulation ([V, G] x [G, D] added into the
fp32 [V, D] accumulator, `addmm`), the fused path's calls, at each of `--group-rows` rows G, with each time per 1000
rows: whether the GEMMs' rate depends on G beyond its size (one hypothesis, not a fact: the d hidden GEMM's few
output tiles, [G, D] in 256 x 128 tiles over an H100's or H200's 132 SMs, fill 1.70 waves at G = 2048 and D = 3584,
1.91 at 2304, 2.33 at 2688), and what the fp32 output costs per group.

Timed as the bench times (the same call, `bench.contenders.Prepared.step`; bench/timing.py: CUDA events, warm-up,
the median of `--repeats`), but each variant's calls back to back rather than in turns with other contenders
(bench/README.md, "How a contender is timed"); the numbers are for choosing what to build, the bench is the
measurement.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import NamedTuple, Optional

import torch

from .geometry import fused_knobs
from .probe_pick import DEFAULT_VARIANT, PROBE_JSON
from .provenance import header_lines, provenance, write_report
from .timing import time_callable

GIB = 1 << 30


class Variant(NamedTuple):
    """One row of part 1: rows, LOGITS_ROWS (None: the library's); group, GROUP_ROWS (None: no cap); gib, the
    workspace (None: the library's); host_layout, the trainer's call."""

    name: str
    rows: Optional[int] = None
    group: Optional[int] = None
    gib: Optional[float] = None
    host_layout: bool = False


VARIANTS = (
    Variant(DEFAULT_VARIANT),
    Variant("host layout (the trainer's call)", host_layout=True),
    Variant("chunk rows 256", rows=256),
    Variant("chunk rows 256, group 2304", rows=256, group=2304),
    Variant("chunk rows 384", rows=384),
    Variant("chunk rows 384, group 2304", rows=384, group=2304),
    Variant("chunk rows 512, group 1536", rows=512, group=1536),
    Variant("chunk rows 768", rows=768),
    Variant("chunk rows 1024", rows=1024),
    Variant("workspace 2 GiB", gib=2),
    Variant("workspace 4 GiB", gib=4),
)
GROUP_ROWS = "1536,2048,2304,2560,2816"  # part 2's group sizes: the 1 GiB default's 2048 and its neighbours
SMOKE = {"shape": "32x128", "n": 32, "rows_per_sample": 16, "group_rows": "8,16", "gib": 1 / 4096, "repeats": 1}


def fused_variants(problem, device, repeats: int, warmup: int, gib_unit: float) -> list:
    """[(Variant, chunk rows, group rows, median ms, p20 ms, p80 ms)] of ours fwd+bwd on `problem`."""
    from erpo_kernels.fused_linear_loss import DEFAULT_WORKSPACE_BYTES, ROW_KERNELS, workspace_of

    from .contenders import erpo_fused_with_workspace

    layout = torch.stack((problem.token_kind, problem.sample_index)).long().cpu()
    out = []
    for variant in VARIANTS:
        budget = DEFAULT_WORKSPACE_BYTES if variant.gib is None else int(variant.gib * gib_unit * GIB)
        prepared = erpo_fused_with_workspace(budget, layout if variant.host_layout else None)(problem)  # the bench's

        with fused_knobs(variant.rows, variant.group):
            plan = workspace_of(problem.num_rows, problem.hidden, problem.weight, ROW_KERNELS["triton"], budget, False)
            timing = time_callable(prepared.step, device=device, warmup=warmup, reps=repeats)
        out.append((variant, plan.chunk_rows, plan.group_rows, timing.median_ms, timing.p20_ms, timing.p80_ms))
    return out


def group_gemms(shape, group_rows: list, device, repeats: int) -> list:
    """[(G, d hidden bf16-out median ms, d hidden fp32-out median ms, d weight += median ms)] of one group's GEMMs at
    each G of group_rows (a case this torch refuses, as the CPU does some: its error, in place of the ms)."""
    from erpo_kernels.fused_linear_loss import write_grad_hidden

    d, v = shape.hidden, shape.vocab
    dtype, most = torch.bfloat16, max(group_rows)
    hidden = torch.randn(most, d, device=device, dtype=dtype)
    weight = torch.randn(v, d, device=device, dtype=dtype) * 0.02
    dlogits = torch.randn(most, v, device=device, dtype=dtype)
    dhidden = {out: torch.empty(most, d, device=device, dtype=out) for out in (dtype, torch.float32)}
    dweight = torch.zeros(v, d, device=device, dtype=torch.float32)
    out = []
    for rows in group_rows:
        def d_hidden(rows=rows, out=dtype):
            write_grad_hidden(dhidden[out][:rows], dlogits[:rows], weight)

        def d_weight(rows=rows):
            torch.addmm(dweight, dlogits[:rows].T, hidden[:rows], out_dtype=torch.float32, out=dweight)

        times = []
        for fn in (d_hidden, functools.partial(d_hidden, out=torch.float32), d_weight):
            try:
                times.append(time_callable(fn, device=device, warmup=2, reps=repeats).median_ms)
            except (RuntimeError, TypeError) as error:  # an overload this torch lacks: say so, go on
                times.append(f"{type(error).__name__}: {str(error)[:80]}")
        out.append((rows, *times))
    return out


def gemm_cells(ms, rows: int) -> str:
    """A part 2 time's two cells: ms and ms per 1000 rows ("-" for a refused case's)."""
    return f"{ms} | -" if isinstance(ms, str) else f"{ms:.3f} | {ms * 1000 / rows:.3f}"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.fused_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-32b")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--group-rows", default=GROUP_ROWS, help="part 2's group sizes G, a comma list")
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
    group_rows = [int(rows) for rows in (SMOKE["group_rows"] if args.smoke else args.group_rows).split(",")]
    repeats, warmup = (SMOKE["repeats"], 0) if args.smoke else (args.repeats, 2)
    name = torch.cuda.get_device_name() if on_cuda else "CPU dry run"
    record = provenance("bench.fused_probe", sys.argv[1:] if argv is None else argv, args.commit)
    lines = [f"# The fused path's variants ({name}, N={n}, bf16)", "", *header_lines(record), ""]
    measured = {"meta": {**record, "device": name, "N": n, "repeats": repeats, "warmup": warmup},  # fused_probe.json:
                "shapes": {}}                                                                     # part 1's rows
    for spec in shapes:
        shape = parse_shape(spec)
        problem = build_problem("fused", shape, n, rows_per_sample=per_sample, query_frac=0.25,
                                dtype=torch.bfloat16, device=device, seed=0, chunk_rows=1024, clip_low=0.2,
                                clip_high=0.2)
        lines += [f"## {shape.name}: D={shape.hidden}, V={shape.vocab}", "",
                  "| variant | chunk rows | group rows | fwd+bwd ms (median) | p20 | p80 |",
                  "|---|---|---|---|---|---|"]
        measured["shapes"][shape.name] = []
        for variant, *row in fused_variants(problem, device, repeats, warmup, SMOKE["gib"] if args.smoke else 1.0):
            lines.append("| {} | {} | {} | {:.2f} | {:.2f} | {:.2f} |".format(variant.name, *row))
            print(lines[-1], flush=True)
            measured["shapes"][shape.name].append(
                dict(zip(("variant", *Variant._fields[1:], "chunk_rows", "group_rows", "median_ms", "p20_ms", "p80_ms"),
                         (*variant, *row))))
        del problem
        if on_cuda:
            torch.cuda.empty_cache()
        lines += ["", "One group's GEMMs by its rows G:", "",
                  "| G | d hidden ms (median) | d hidden ms per 1000 rows | d hidden fp32-out ms (median) | "
                  "d hidden fp32-out ms per 1000 rows | d weight += ms (median) | d weight += ms per 1000 rows |",
                  "|---|---|---|---|---|---|---|"]
        for rows, *times in group_gemms(shape, group_rows, device, repeats):
            lines.append(f"| {rows} | " + " | ".join(gemm_cells(ms, rows) for ms in times) + " |")
            print(lines[-1], flush=True)
        lines.append("")
        if on_cuda:
            torch.cuda.empty_cache()
    report = write_report(args.out, "fused_probe.md", lines)
    report.with_name(PROBE_JSON).write_text(json.dumps(measured, indent=1) + "\n")


if __name__ == "__main__":
    main()
