"""Which epilogue GEMM config and launch gpu_check's bench 1 times erpo-epi at, read from bench.gemm_epilogue_probe's
gemm_epilogue_probe.json: among the (d) variants (the Triton GEMM with the row statistics in its epilogue, then the
combine) that passed their check on the device and were timed, at the fused loss's chunk rows (PICK_ROWS), the one
with the lowest sum over the probe's shapes of its median over the library's own (d) at that shape
(`triton_logits_gemm.LOSS_CONFIGS`' bf16 entry without a soft-cap, grouped, pointer loads: what erpo-epi runs);
picked only if it is faster than the library's on every shape, as the contender key `erpo-epi-...` (bench.geometry)
that takes erpo-epi's place in bench 1. So one lease's bench run times the whole fused call at the probe's best
GEMM instead of the library's guess; a failing variant (a wrong value on the device) is never picked.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from .geometry import EpilogueLaunch, epilogue_key
from .probe_pick import Pick, lowest_sum_pick

PROBE_JSON = "gemm_epilogue_probe.json"  # what bench.gemm_epilogue_probe writes beside its report, after each chunk
# The chunk rows the pick compares at: fused_linear_loss.LOGITS_ROWS, the 1 GiB default's chunk at both lm_heads
# (V = 152064; the fused probe's "library default" rows), so the rows bench 1's erpo-epi forms its logits in. The
# probe's 2048-row chunks are a taller GEMM than any the loss runs by default: they say where the Triton GEMM's tiles
# fill more waves, not what erpo-epi would gain.
PICK_ROWS = 512
# summary.md's line of the pick (bench.gpu_check), which bench.decide reads
SUMMARY_LABEL = "bench 1's epilogue pick (erpo-epi's place; none: erpo-epi at the library's config and launch)"
EPILOGUE_PART = "d"  # the probe's part of the GEMM with the row statistics in its epilogue and the combine
# the probe's strings for a config (GemmConfig's) and a launch (Launch's)
CONFIG_FORM = re.compile(r"(\d+)x(\d+)x(\d+) w(\d+) s(\d+)")
LAUNCH_FORM = re.compile(r"(?:grouped|persistent \((\d+)\))(, TMA)?")


def library_variant() -> tuple:
    """(config, launch) as the probe's rows write them, of the fused loss's own epilogue GEMM for bf16 operands
    without a soft-cap (the probe's identity transform): LOSS_CONFIGS' entry, LOSS_LAUNCH."""
    from erpo_kernels import triton_logits_gemm as gemm  # Triton: imported when a pick is made
    return str(gemm.LOSS_CONFIGS[(2, False)]), str(gemm.LOSS_LAUNCH)


def probe_variant(config: str, launch: str) -> EpilogueLaunch:
    """The config and launch of a probe row's strings ("128x256x64 w8 s3", "persistent (132), TMA"); ValueError if
    either is not in the probe's form."""
    config_found, launch_found = CONFIG_FORM.fullmatch(config), LAUNCH_FORM.fullmatch(launch)
    if config_found is None or launch_found is None:
        raise ValueError(f"no config and launch in {config!r}, {launch!r}")
    programs = launch_found[1] and int(launch_found[1])
    return EpilogueLaunch(tuple(map(int, config_found.groups())), programs, launch_found[2] is not None)


def pick_epilogue(probe_json: Path, shapes, rows: int = PICK_ROWS, library: Optional[tuple] = None) -> Pick:
    """The pick (module docstring) over `shapes` (the probe's shape names) at chunks of `rows` rows against `library`
    ((config, launch) strings; None: the loss's own, `library_variant`) from the probe's results file, which a probe
    stopped at its time limit leaves with the chunks it finished; nothing picked when the file is missing or
    unreadable, holds no chunk of `rows` rows for some shape, no passing timed (d) row of the library's on some shape,
    or no other passing (d) variant timed on every shape. gpu_check's dry run passes the smoke run's shape, rows and
    first config."""
    if not probe_json.exists():
        return Pick(None, f"none: no {probe_json.name} (the epilogue probe finished no chunk)")
    try:
        chunks = json.loads(probe_json.read_text(encoding="utf-8"))["chunks"]
        measured = {chunk["shape"]: chunk["results"] for chunk in chunks if chunk["rows"] == rows}
        missing = [shape for shape in shapes if shape not in measured]
        if missing:
            return Pick(None, f"none: no chunk of {rows} rows at {', '.join(missing)} in {probe_json.name}")
        return _pick({shape: measured[shape] for shape in shapes}, rows, library or library_variant())
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as error:  # the lease goes on without a pick
        return Pick(None, f"none: {probe_json.name} unreadable ({type(error).__name__}: {error})")


def _pick(shapes: dict, rows: int, library: tuple) -> Pick:
    named = f"the library's (d) ({', '.join(library)})"
    ratios = {}  # (config, launch) -> {shape: its median / the library's}
    for shape, results in shapes.items():
        timed = {(row["config"], row["launch"]): row["median_ms"] for row in results
                 if row["part"] == EPILOGUE_PART and row["passed"] and "median_ms" in row}
        if library not in timed:
            return Pick(None, f"none: {named} did not pass its check or was not timed at {shape}, {rows} rows")
        for variant, median in timed.items():
            if variant != library:
                ratios.setdefault(variant, {})[shape] = median / timed[library]

    def label(variant: tuple) -> tuple:
        key = epilogue_key(probe_variant(*variant))
        return key, f"(d) {', '.join(variant)} ({key}) at {rows} rows,"
    return lowest_sum_pick(ratios, shapes, label, named, "the library's", "other passing (d) variant")
