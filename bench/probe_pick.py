"""Which chunk geometry gpu_check's bench 1 times beside ours and torch.compile, read from bench.fused_probe's
fused_probe.json: among the variants that set only the chunk rows and group rows (`LOGITS_ROWS`, `GROUP_ROWS`) at the
1 GiB default (not the workspace variants, not the host layout), the one with the lowest sum over the probe's shapes
of its fwd+bwd median over that shape's "library default" median; picked only if it is faster than the library
default on every shape. So one lease's bench run shows the candidate's targets beside erpo and torch.compile.
The rule itself (`lowest_sum_pick`) is bench.epilogue_pick's too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Optional

from .geometry import Geometry, geometry_key

PROBE_JSON = "fused_probe.json"  # what bench.fused_probe writes beside fused_probe.md: part 1's rows
DEFAULT_VARIANT = "library default"  # bench.fused_probe's row of the library's own geometry
SUMMARY_LABEL = "bench 1's geometry pick"  # summary.md's line of the pick (bench.gpu_check), which bench.decide reads
# what a pick's why says where the probe measured every shape and the lowest-sum variant lost somewhere: the one "none"
# that is a measurement (bench.decide: the rule's keep), not a missing or unreadable input
NOT_FASTER = "not faster than"


class Pick(NamedTuple):
    """key: the contender key bench 1 adds (erpo-geom-ROWS[-GROUP]), None when nothing is picked; why: one line."""

    key: Optional[str]
    why: str


def probe_geometry(row: dict) -> Optional[Geometry]:
    """The geometry a fused_probe.json row sets, None unless it sets only LOGITS_ROWS / GROUP_ROWS at the default
    workspace (a row that caps only the group keeps the library's chunk rows, which its plan records)."""
    if row["gib"] is not None or row["host_layout"] or (row["rows"] is None and row["group"] is None):
        return None
    return Geometry(row["chunk_rows"] if row["rows"] is None else row["rows"], row["group"])


def pick_geometry(probe_json: Path) -> Pick:
    """The pick (module docstring) from the probe's results file; nothing picked when it is missing or unreadable or
    holds no default row or no geometry variant on some shape."""
    if not probe_json.exists():
        return Pick(None, f"none: no {probe_json.name} (the probe did not finish)")
    try:
        return _pick(json.loads(probe_json.read_text(encoding="utf-8"))["shapes"])
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as error:  # the lease goes on without a pick
        return Pick(None, f"none: {probe_json.name} unreadable ({type(error).__name__}: {error})")


def _pick(shapes: dict) -> Pick:
    ratios = {}  # variant name -> {shape: its median / the default's}
    for shape, rows in shapes.items():
        default = [row["median_ms"] for row in rows if row["variant"] == DEFAULT_VARIANT]
        if not default:
            return Pick(None, f"none: no {DEFAULT_VARIANT!r} row for {shape}")
        for row in rows:
            if probe_geometry(row) is not None:
                ratios.setdefault(row["variant"], {})[shape] = row["median_ms"] / default[0]
    def named(best: str) -> tuple:
        (row,) = [row for row in next(iter(shapes.values())) if row["variant"] == best]
        key = geometry_key(probe_geometry(row))
        return key, f"{best!r} ({key}), fwd+bwd"
    return lowest_sum_pick(ratios, shapes, named, "the library default's", "the library default", "geometry variant")


def lowest_sum_pick(ratios: dict, shapes, named, over: str, than: str, kind: str) -> Pick:
    """The rule both probes' picks follow: among the variants of `ratios` ({variant: {shape: its median over the
    baseline's}}) measured on every shape of `shapes`, the one with the lowest sum of ratios, picked only if each is
    below 1. named(variant) gives its (contender key, label); why names it, its ratios and sum "median over `over`",
    how many `kind`s it was the lowest of, and whether it is faster than `than` on every shape."""
    complete = {variant: by_shape for variant, by_shape in ratios.items() if by_shape.keys() == set(shapes)}
    if not shapes or not complete:
        return Pick(None, f"none: no {kind} measured on every shape")
    best = min(complete, key=lambda variant: sum(complete[variant].values()))
    key, label = named(best)
    measured = (f"{label} median over {over} " + ", ".join(f"{shape} {ratio:.3f}" for shape, ratio in
                                                           complete[best].items())
                + f", sum {sum(complete[best].values()):.3f}, the lowest of {len(complete)} {kind}s")
    if all(ratio < 1 for ratio in complete[best].values()):
        return Pick(key, f"{key}: {measured}, faster than {than} on every shape")
    return Pick(None, f"none: {measured}, {NOT_FASTER} {than} on every shape")
