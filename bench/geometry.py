"""The fused path's private knobs as the bench sets them for a block of calls (`fused_constants`): its chunk geometry,
`fused_linear_loss.LOGITS_ROWS` (a chunk's rows beside the dlogits store) and `fused_linear_loss.GROUP_ROWS` (a cap
on the store's rows, whole chunks), set by `fused_knobs` (bench.fused_probe's variants, the bench's `erpo-geom-*`
contenders), `fused_linear_loss.GRAD_HIDDEN_FP32` (d hidden held in fp32, the contender `erpo-dh32`) and
`fused_linear_loss.EPILOGUE_ROW_PASS` (the forward row pass in the logits GEMM's epilogue, the contender
`erpo-epi`); and the contender key that names a geometry: `erpo-geom-ROWS` or `erpo-geom-ROWS-GROUP`.
"""
from __future__ import annotations

import contextlib
import re
from typing import NamedTuple, Optional

GEOMETRY_PREFIX = "erpo-geom-"
KEY_FORM = "erpo-geom-ROWS or erpo-geom-ROWS-GROUP (chunk rows, group rows a multiple of them, e.g. erpo-geom-256-2304)"


class Geometry(NamedTuple):
    """rows: LOGITS_ROWS, a chunk's rows; group: GROUP_ROWS, the store's rows at most (None: no cap)."""

    rows: int
    group: Optional[int] = None


@contextlib.contextmanager
def fused_constants(**values):
    """The `fused_linear_loss` module constants named by `values` (LOGITS_ROWS=512, EPILOGUE_ROW_PASS=True, ...) set
    while the block runs, each put back after it, also on an exception; AttributeError for a name the module lacks."""
    from erpo_kernels import fused_linear_loss
    saved = {name: getattr(fused_linear_loss, name) for name in values}
    try:
        for name, value in values.items():
            setattr(fused_linear_loss, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(fused_linear_loss, name, value)


def fused_knobs(rows: Optional[int], group: Optional[int]):
    """`fused_linear_loss.LOGITS_ROWS` = rows (None: the library's) and `GROUP_ROWS` = group (None: no cap) while the
    block runs (`fused_constants`)."""
    return fused_constants(GROUP_ROWS=group) if rows is None else fused_constants(LOGITS_ROWS=rows, GROUP_ROWS=group)


def is_geometry_key(key: str) -> bool:
    """Whether `key` is meant as a geometry contender (well formed or not: `parse_geometry_key` says)."""
    return key.startswith(GEOMETRY_PREFIX)


def geometry_key(geometry: Geometry) -> str:
    """The contender key of `geometry`: erpo-geom-256-2304, or erpo-geom-256 without a group cap."""
    return GEOMETRY_PREFIX + "-".join(str(count) for count in geometry if count is not None)


def parse_geometry_key(key: str) -> Geometry:
    """The geometry `key` names; ValueError (one line: the key and the form expected) if it is malformed."""
    found = re.fullmatch(re.escape(GEOMETRY_PREFIX) + r"([1-9]\d*)(?:-([1-9]\d*))?", key)
    rows, group = (None, None) if found is None else (int(found[1]), found[2] and int(found[2]))
    if rows is None or (group is not None and group % rows):
        raise ValueError(f"{key!r} is no geometry contender; expected {KEY_FORM}")
    return Geometry(rows, group)
