"""Which chunk geometry gpu_check's bench 1 times beside ours and torch.compile, read from bench.fused_probe's
fused_probe.json: among the variants that set only the chunk rows and group rows (`LOGITS_ROWS`, `GROUP_ROWS`) at the
1 GiB default (not the workspace variants, not the host layout), the one with the lowest sum over the probe's shapes
of its fwd+bwd median over that shape's "library default" median; picked only if it is faster than the library
default on every shape. So one lease's bench run shows the candidate's targets beside erpo and torch.compile.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Optional

from .geometry import Geometry, geometry_key

PROBE_JSON = "fused_probe.json"  # what bench.fused_probe writes beside fused_probe.md: part 1's rows
DEFAULT_VARIANT = "library default"  # bench.fused_probe's row of the library's own geometry


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
    complete = {name: by_shape for name, by_shape in ratios.items() if by_shape.keys() == shapes.keys()}
    if not shapes or not complete:
        return Pick(None, "none: no geometry variant measured on every shape")
    best = min(complete, key=lambda name: sum(complete[name].values()))
    (row,) = [row for row in next(iter(shapes.values())) if row["variant"] == best]
    key = geometry_key(probe_geometry(row))
    measured = (f"{best!r} ({key}), fwd+bwd median over the library default's "
                + ", ".join(f"{shape} {ratio:.3f}" for shape, ratio in complete[best].items())
                + f", sum {sum(complete[best].values()):.3f}, the lowest of {len(complete)} geometry variants")
    if all(ratio < 1 for ratio in complete[best].values()):
        return Pick(key, f"{key}: {measured}, faster than the library default on every shape")
    return Pick(None, f"none: {measured}, not faster than the library default on every shape")
