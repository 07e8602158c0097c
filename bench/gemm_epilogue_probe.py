"""Can the fused path's forward row pass move into its logits GEMM's epilogue, in one short GPU run: a Triton GEMM
at the chunks' shape beside cuBLAS, with and without the row statistics in its epilogue (issue 32).

    python -m bench.gemm_epilogue_probe --shapes qwen2.5-7b,qwen2.5-32b --rows 512,2048 --out DIR
    TRITON_INTERPRET=1 python -m bench.gemm_epilogue_probe --smoke --out DIR     # CPU, tiny: the dry run

Per shape (D, V) and chunk rows n, one chunk's [n, D] x [D, V] product with fp32 output, bf16 operands:

  (a) cuBLAS: `fused_linear_loss._write_logits`, the fused path's own call (`torch.mm(h, W.t(),
      out_dtype=torch.float32, out=buffer)` on CUDA);
  (b) (a), then the library's forward row kernel on the buffer (`fused_linear_loss.ROW_KERNELS["triton"].forward`):
      what the fused path does per chunk, (logp, entropy, lse) of every row;
  (c) the library's Triton GEMM (erpo_kernels/triton_logits_gemm.py, `logits_gemm`) writing the fp32 logits, per
      config of CONFIGS (BLOCK_M x BLOCK_N x BLOCK_K, warps, stages), in four launches (`launches`): grouped (one
      program per output tile, GROUP_M row tiles side by side, the Triton matmul tutorial's swizzle, so that a
      wave's programs share their operands in L2) and persistent (one program per SM, each walking the tiles in
      that grouped order), each with its operands loaded through pointers (cp.async, compiled) and through TMA
      tensor descriptors (Hopper's copy engine);
  (d) the same GEMM with the row statistics in its epilogue, then the library's combine (`combine_stats`): per
      (row, vocabulary tile) the tile's max m, s = sum exp(z - m) and u = sum exp(z - m) (z - m)
      (`triton_common.online_softmax_step`, the forward row kernels' own step: u is shifted by m, no cancellation in
      the entropy) into a [n, tiles, 3] fp32 side buffer, the fp32 logits still written (the backward row pass
      reads them); the combine merges a row's tiles into (logp, entropy, lse) as the forward row kernel defines
      them (its docstring has the merge), the target's logit read from the buffer. The identity transform
      (temperature 1, no logit scale, no soft-cap) and no bias here; the fused loss's use of (d), with every
      transform and a bias, is `fused_linear_loss.EPILOGUE_ROW_PASS` (bench 1's contender erpo-epi times it whole).

Before it is timed, each variant is checked on the device against (a) (logits) and (b) (logp, entropy, lse): its
largest absolute errors are in the report, and a variant beyond LOGITS_TOLERANCE or STATS_TOLERANCE is marked
failing and never named the best (its time is still shown). Times: bench/timing.py's `time_callable` (CUDA events,
2 warm-up calls, the median of `--repeats`); TFLOP/s is 2 n D V over the time. The answer per (shape, rows): the best
passing (d) against (b), per chunk and, as arithmetic on this run's medians (not a measurement), over N = 16384
rows in chunks of n (ceil(N / n) times the chunk's time).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import NamedTuple

import torch

from erpo_kernels.triton_logits_gemm import (
    GROUP_M,
    INTERPRETED,
    GemmConfig,
    Launch,
    combine_stats,
    logits_gemm,
    sm_count,
    tile_count,
)
from erpo_kernels.validation import IGNORE_INDEX, LogitTransform

from .provenance import header_lines, provenance, write_report
from .timing import time_callable

LOGITS_TOLERANCE = 1e-4     # largest |logit - cuBLAS's| over (1 + largest |logit|): both sum exact bf16 products in
#                             fp32, in different orders (about 1e-6 expected at D = 3584 with the probe's data)
STATS_TOLERANCE = 1e-4      # nats, largest |lse|, |entropy|, |logp| error against (b)'s (about 1e-6 expected): a
#                             column counted twice or lost moves lse by exp(z_j - lse), about 1 / V = 7e-6 at
#                             V = 152064, below this; the interpreter's tests (small V) catch those
PROBE_N = 16384             # the rows the answer's arithmetic scales a chunk's time to (the fused targets' N)


# Hopper-sized tiles: operand stages of (BLOCK_M + BLOCK_N) BLOCK_K bf16 each, 144 KiB for three 128x256x64 ones,
# within an H100's 227 KiB of shared memory per block
CONFIGS = (GemmConfig(128, 256, 64, 8, 3), GemmConfig(128, 128, 64, 4, 4), GemmConfig(256, 128, 64, 8, 3))


def launches(programs: int) -> tuple:
    """The launches each config is timed in: grouped and persistent on `programs` programs, pointers then TMA."""
    return tuple(Launch(persistent, tma) for tma in (False, True) for persistent in (None, programs))


# the dry run: D = 40 and V = 200 are multiples of no block (the K step's mask, the ragged vocabulary tile), 24 rows
# of neither block's rows; the persistent launches on the CPU's `sm_count`, INTERPRETER_SMS (3) programs, so that
# each walks several tiles
SMOKE = {"shape": "40x200", "rows": "24", "configs": (GemmConfig(16, 32, 16, 4, 1), GemmConfig(32, 64, 16, 4, 2)),
         "repeats": 1}


class Variant(NamedTuple):
    """One timed row: its part ("a" to "d"), its config and launch (None for cuBLAS's parts) and its call."""

    part: str
    config: GemmConfig | None
    launch: Launch | None
    call: object


class Chunk:
    """One chunk's inputs and outputs at (rows, D, V): bf16 hidden [rows, D] and weight [V, D] (scaled as the bench's
    lm_head, 0.02), targets [rows] with every fourth -100 (the query rows' share), the fp32 logits buffer and the
    three [rows] fp32 vectors, one set shared by every variant; (a)'s logits and (b)'s vectors kept as the reference."""

    def __init__(self, rows: int, dim: int, vocab: int, device: torch.device, seed: int = 0):
        generator = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: W is 1.6 GB at 32b
        self.hidden = torch.randn(rows, dim, generator=generator, device=device).to(torch.bfloat16)
        self.weight = (torch.randn(vocab, dim, generator=generator, device=device) * 0.02).to(torch.bfloat16)
        self.targets = torch.randint(0, vocab, (rows,), generator=generator, device=device)
        self.targets[::4] = IGNORE_INDEX
        self.transform = LogitTransform()  # the identity: temperature 1, no scale, no soft-cap
        self.logits = torch.empty(rows, vocab, device=device, dtype=torch.float32)
        self.vectors = tuple(torch.empty(rows, device=device, dtype=torch.float32) for _ in range(3))
        self.side_buffers = []  # (d)'s [rows, tiles, 3] statistics, one per config (`variants`)
        self.cublas()
        self.row_pass()
        self.reference_logits = self.logits.clone()
        self.reference_vectors = tuple(vector.clone() for vector in self.vectors)

    def cublas(self) -> None:
        """(a): the fused path's logits GEMM into the buffer."""
        from erpo_kernels.fused_linear_loss import _write_logits
        _write_logits(self.logits, self.hidden, self.weight, None)

    def row_pass(self) -> None:
        """The library's forward row kernel on the buffer, into the vectors (logp, entropy, lse)."""
        from erpo_kernels.fused_linear_loss import ROW_KERNELS
        ROW_KERNELS["triton"].forward(self.logits, self.targets, self.transform, self.vectors)

    def variants(self, configs, programs: int) -> list:
        """[Variant] of parts (a) to (d): (c) and (d) once per config and launch (`launches(programs)`)."""
        out = [Variant("a", None, None, self.cublas),
               Variant("b", None, None, lambda: (self.cublas(), self.row_pass()))]
        for part in ("c", "d"):
            for config in configs:
                stats = None
                if part == "d":
                    stats = torch.empty(self.logits.shape[0], tile_count(self.logits.shape[1], config), 3,
                                        device=self.logits.device)
                    self.side_buffers.append(stats)
                for launch in launches(programs):
                    out.append(Variant(part, config, launch, self._triton_call(config, launch, stats)))
        return out

    def _triton_call(self, config, launch: Launch, stats):
        def call():
            logits_gemm(self.hidden, self.weight, self.logits, config, launch, stats)
            if stats is not None:
                combine_stats(stats, self.logits, self.targets, self.vectors)
        return call

    def reset(self) -> None:
        """NaN into every output buffer: what a variant leaves unwritten (a tile skipped, a statistic not stored) then
        fails its check instead of passing on an earlier variant's values."""
        for buffer in (self.logits, *self.vectors, *self.side_buffers):
            buffer.fill_(math.nan)

    def errors(self, part: str) -> dict:
        """The largest absolute errors of what `part`'s call just wrote: logits against (a)'s and, for (b) and (d),
        logp, entropy and lse against (b)'s (NaN where any value is not finite)."""
        def largest(value, reference):
            return float((value - reference).abs().max()) if bool(value.isfinite().all()) else math.nan

        out = {"logits": largest(self.logits, self.reference_logits)}
        if part in ("b", "d"):
            out.update(zip(("logp", "entropy", "lse"), map(largest, self.vectors, self.reference_vectors)))
        return out

    def passes(self, errors: dict) -> bool:
        """Whether `errors` are within LOGITS_TOLERANCE (relative to the largest logit) and STATS_TOLERANCE."""
        logit_bound = LOGITS_TOLERANCE * (1.0 + float(self.reference_logits.abs().max()))
        return all(error <= (logit_bound if name == "logits" else STATS_TOLERANCE) for name, error in errors.items())


def probe_chunk(rows: int, dim: int, vocab: int, device: torch.device, configs, programs: int, repeats: int,
                warmup: int) -> list:
    """[row dict] of every variant at one chunk: part, config, launch, errors, passed, median / p20 / p80 ms and
    TFLOP/s (2 rows D V over the median), or the error a variant raised (then not timed)."""
    chunk = Chunk(rows, dim, vocab, device)
    flops = 2 * rows * dim * vocab
    out = []
    for variant in chunk.variants(configs, programs):
        row = {"part": variant.part, "config": None if variant.config is None else str(variant.config),
               "launch": None if variant.launch is None else str(variant.launch)}
        try:
            chunk.reset()
            variant.call()
            row["errors"] = chunk.errors(variant.part)
            row["passed"] = chunk.passes(row["errors"])
            timing = time_callable(variant.call, device=device, warmup=warmup, reps=repeats)
        except Exception as error:  # a config this device refuses (shared memory, registers): say so, go on
            row.update(passed=False, error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
        else:
            row.update(median_ms=timing.median_ms, p20_ms=timing.p20_ms, p80_ms=timing.p80_ms,
                       tflops=flops / timing.median_ms / 1e9)
        out.append(row)
    return out


def best(rows: list, part: str):
    """The fastest timed row of `part` that passed its check, or None."""
    passing = [row for row in rows if row["part"] == part and row["passed"] and "median_ms" in row]
    return min(passing, key=lambda row: row["median_ms"], default=None)


def answer(rows: list, chunk_rows: int, total_rows: int = PROBE_N) -> dict:
    """Does (d) beat (b) at this chunk: the best passing (d)'s and (b)'s medians, their difference per chunk (ms,
    positive: (d) faster) and ratio, and both over total_rows rows in chunks of chunk_rows (arithmetic on these
    medians, not a measurement); the best (c) against (a) beside it. None where a part has no passing row."""
    chunks = math.ceil(total_rows / chunk_rows)
    pairs = {}
    for ours, theirs in (("d", "b"), ("c", "a")):
        mine, base = best(rows, ours), best(rows, theirs)
        pairs[ours] = None if mine is None or base is None else {
            "config": mine["config"], "launch": mine["launch"], "ms": mine["median_ms"], "base_ms": base["median_ms"],
            "saved_ms": base["median_ms"] - mine["median_ms"], "ratio": mine["median_ms"] / base["median_ms"],
            "chunks": chunks, "total_ms": chunks * mine["median_ms"], "base_total_ms": chunks * base["median_ms"]}
    return pairs


PART_NAMES = {"a": "(a) cuBLAS logits", "b": "(b) cuBLAS + forward row kernel", "c": "(c) Triton GEMM",
              "d": "(d) Triton GEMM + row stats + combine"}


def table_lines(rows: list) -> list:
    """One chunk's rows as a markdown table."""
    lines = ["| part | config | launch | ms (median) | p20 | p80 | TFLOP/s | max error: logits | lse | entropy | "
             "logp | check |", "|---" * 12 + "|"]
    for row in rows:
        errors = row.get("errors", {})
        cells = [f"{errors[name]:.2e}" if name in errors else "-" for name in ("logits", "lse", "entropy", "logp")]
        times = ([f"{row[key]:.3f}" for key in ("median_ms", "p20_ms", "p80_ms")] + [f"{row['tflops']:.3g}"]
                 if "median_ms" in row else ["-"] * 4)
        check = "passed" if row["passed"] else ("error: " + row["error"] if "error" in row else "FAILED")
        lines.append(f"| {PART_NAMES[row['part']]} | {row['config'] or '-'} | {row['launch'] or '-'} | "
                     + " | ".join(times + cells) + f" | {check} |")
    return lines


def answer_lines(pairs: dict, chunk_rows: int) -> list:
    """The answer's sentences for one chunk (`answer`'s)."""
    lines = []
    for ours, theirs, what in (("d", "b", "the forward row pass in the GEMM's epilogue"),
                               ("c", "a", "the Triton GEMM alone against cuBLAS")):
        pair = pairs[ours]
        if pair is None:
            lines.append(f"- {what}: no answer, ({ours}) or ({theirs}) has no passing timed row")
            continue
        verdict = "beats" if pair["saved_ms"] > 0 else "does not beat"
        lines.append(f"- {what}: ({ours}) {pair['config']} {pair['launch']} {verdict} ({theirs}): {pair['ms']:.3f} "
                     f"against {pair['base_ms']:.3f} ms per chunk of {chunk_rows} rows ({pair['saved_ms']:+.3f} ms "
                     f"saved, {pair['ratio']:.3f}x); over N={PROBE_N} in {pair['chunks']} chunks, "
                     f"{pair['total_ms']:.1f} against {pair['base_total_ms']:.1f} ms (arithmetic from this run's "
                     "medians, not a measurement)")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.gemm_epilogue_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-32b")
    parser.add_argument("--rows", default="512,2048", help="chunk rows n, a comma list")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, Triton interpreter: a dry run")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD, if any)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from .problem import parse_shape
    if args.smoke and not INTERPRETED:
        raise SystemExit("bench.gemm_epilogue_probe: --smoke runs the kernels in Triton's interpreter; set "
                         "TRITON_INTERPRET=1 (TRITON_INTERPRET=1 python -m bench.gemm_epilogue_probe --smoke ...)")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench.gemm_epilogue_probe: needs a CUDA device (or --smoke for the CPU dry run)")
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = [parse_shape(spec) for spec in (SMOKE["shape"] if args.smoke else args.shapes).split(",")]
    chunk_rows = [int(rows) for rows in (SMOKE["rows"] if args.smoke else args.rows).split(",")]
    configs = SMOKE["configs"] if args.smoke else CONFIGS
    repeats, warmup = (SMOKE["repeats"], 0) if args.smoke else (args.repeats, 2)
    programs = sm_count(device)  # an explicit count, the one the key of a persistent pick names
    name = "CPU dry run" if args.smoke else torch.cuda.get_device_name()
    record = provenance("bench.gemm_epilogue_probe", sys.argv[1:] if argv is None else argv, args.commit)
    lines = [f"# The logits GEMM with the row statistics in its epilogue ({name}, bf16 operands, fp32 logits)", "",
             *header_lines(record),
             f"- (c), (d): Triton GEMM configs {', '.join(map(str, configs))}; launches "
             f"{'; '.join(map(str, launches(programs)))} (persistent (P): P programs, the device's SM count, "
             "`sm_count`); "
             "(d)'s row statistics for the identity transform (temperature 1, no scale or soft-cap)",
             f"- checks: logits within {LOGITS_TOLERANCE:g} x (1 + largest |logit|) of (a)'s, lse / entropy / logp "
             f"within {STATS_TOLERANCE:g} nats of (b)'s; a FAILED row is timed but never the best", ""]
    measured = {"meta": {**record, "device": name, "repeats": repeats, "warmup": warmup, "programs": programs,
                         "configs": [str(config) for config in configs], "group_m": GROUP_M,
                         "logits_tolerance": LOGITS_TOLERANCE, "stats_tolerance": STATS_TOLERANCE},
                "chunks": []}
    for shape in shapes:
        for rows in chunk_rows:
            results = probe_chunk(rows, shape.hidden, shape.vocab, device, configs, programs, repeats, warmup)
            pairs = answer(results, rows)
            block = [f"## {shape.name}: D={shape.hidden}, V={shape.vocab}, {rows} rows", "", *table_lines(results),
                     "", *answer_lines(pairs, rows), ""]
            lines += block
            print("\n".join(block), flush=True)
            measured["chunks"].append({"shape": shape.name, "hidden": shape.hidden, "vocab": shape.vocab,
                                       "rows": rows, "results": results, "answer": pairs})
            # written after every chunk: a run stopped at its time limit (bench/gpu_check.py) leaves the chunks done
            report = write_report(args.out, "gemm_epilogue_probe.md", lines)
            report.with_name("gemm_epilogue_probe.json").write_text(json.dumps(measured, indent=1) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()  # this chunk's buffers, freed with it


if __name__ == "__main__":
    main()
