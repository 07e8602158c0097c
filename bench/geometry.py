"""The fused path's private knobs as the bench sets them for a block of calls (`fused_constants`): its chunk geometry,
`fused_linear_loss.LOGITS_ROWS` (a chunk's rows beside the dlogits store) and `fused_linear_loss.GROUP_ROWS` (a cap
on the store's rows, whole chunks), set by `fused_knobs` (bench.fused_probe's variants, the bench's `erpo-geom-*`
contenders), `fused_linear_loss.GRAD_HIDDEN_FP32` (d hidden held in fp32, the contender `erpo-dh32`) and
`fused_linear_loss.EPILOGUE_ROW_PASS` (the forward row pass in the logits GEMM's epilogue, the contender
`erpo-epi`); the contender key that names a geometry: `erpo-geom-ROWS` or `erpo-geom-ROWS-GROUP`; and the one that
names the epilogue GEMM's config and launch for erpo-epi (`epilogue_knobs`, bench.epilogue_pick's pick):
`erpo-epi-BMxBNxBK-wW-sS[-persistentP|-persistentsm][-tma]` (-persistentsm: one program per SM of the device at
each call, `triton_logits_gemm.DEVICE_SMS`, the library's form of a persistent launch).
"""
from __future__ import annotations

import contextlib
import re
from typing import NamedTuple, Optional, Union

GEOMETRY_PREFIX = "erpo-geom-"
KEY_FORM = "erpo-geom-ROWS or erpo-geom-ROWS-GROUP (chunk rows, group rows a multiple of them, e.g. erpo-geom-256-2304)"
EPILOGUE_PREFIX = "erpo-epi-"
# `triton_logits_gemm.DEVICE_SMS`'s value, a launch of one program per SM of the device at each call (-persistentsm):
# not imported, so that the keys parse without Triton (bench.decide); tests/kernels/test_bench_geometry.py holds them
# equal
DEVICE_SMS = "device SMs"
EPILOGUE_KEY_FORM = ("erpo-epi-BMxBNxBK-wW-sS[-persistentP|-persistentsm][-tma] (the GEMM's tile, K step, warps "
                     "and stages, powers of two but the stages; P persistent programs, sm one per SM of the device; "
                     "TMA loads), e.g. "
                     "erpo-epi-128x256x64-w8-s3-persistent132-tma")


class Geometry(NamedTuple):
    """rows: LOGITS_ROWS, a chunk's rows; group: GROUP_ROWS, the store's rows at most (None: no cap)."""

    rows: int
    group: Optional[int] = None


class EpilogueLaunch(NamedTuple):
    """The epilogue GEMM's config (`triton_logits_gemm.GemmConfig`'s fields: tile rows and columns, K step, warps,
    stages) and launch (`triton_logits_gemm.Launch`'s: persistent programs, a count or DEVICE_SMS, None for one a
    tile; TMA loads)."""

    config: tuple
    programs: Union[int, str, None] = None
    tma: bool = False


@contextlib.contextmanager
def module_constants(module, **values):
    """`module`'s constants named by `values` set while the block runs, each put back after it, also on an exception;
    AttributeError for a name the module lacks."""
    saved = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def fused_constants(**values):
    """The `fused_linear_loss` module constants named by `values` (LOGITS_ROWS=512, EPILOGUE_ROW_PASS=True, ...) set
    while the block runs (`module_constants`)."""
    from erpo_kernels import fused_linear_loss
    return module_constants(fused_linear_loss, **values)


@contextlib.contextmanager
def epilogue_knobs(epilogue: EpilogueLaunch):
    """EPILOGUE_ROW_PASS with the epilogue GEMM at `epilogue`'s config for bf16 / fp16 operands without a soft-cap
    (`triton_logits_gemm.LOSS_CONFIGS`' entry that the bench's lm_heads use, the one the probe times) and its launch
    (`LOSS_LAUNCH`, for every entry) while the block runs, all put back after it."""
    from erpo_kernels import triton_logits_gemm as gemm
    config = gemm.GemmConfig(*epilogue.config)
    with module_constants(gemm, LOSS_CONFIGS={**gemm.LOSS_CONFIGS, (2, False): config},
                          LOSS_LAUNCH=gemm.Launch(epilogue.programs, epilogue.tma)), \
            fused_constants(EPILOGUE_ROW_PASS=True):
        yield


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


def is_epilogue_key(key: str) -> bool:
    """Whether `key` is meant as an epilogue GEMM contender (well formed or not: `parse_epilogue_key` says)."""
    return key.startswith(EPILOGUE_PREFIX)


def epilogue_key(epilogue: EpilogueLaunch) -> str:
    """The contender key of `epilogue`: erpo-epi-128x256x64-w8-s3, then -persistentP (-persistentsm for DEVICE_SMS)
    and -tma where they are set."""
    block_m, block_n, block_k, warps, stages = epilogue.config
    programs = "sm" if epilogue.programs == DEVICE_SMS else epilogue.programs or ""
    return (f"{EPILOGUE_PREFIX}{block_m}x{block_n}x{block_k}-w{warps}-s{stages}"
            + (f"-persistent{programs}" if programs else "") + ("-tma" if epilogue.tma else ""))


def parse_epilogue_key(key: str) -> EpilogueLaunch:
    """The config and launch `key` names; ValueError (one line: the key and the form expected) if it is malformed or
    names a block or warp count that is no power of two (Triton's tiles) or no stage."""
    number = r"([1-9]\d*)"
    found = re.fullmatch(re.escape(EPILOGUE_PREFIX) + f"{number}x{number}x{number}-w{number}-s{number}"
                         r"(?:-persistent([1-9]\d*|sm))?(-tma)?", key)
    config = () if found is None else tuple(int(found[index]) for index in range(1, 6))
    if not config or not all(count & (count - 1) == 0 for count in config[:4]):
        raise ValueError(f"{key!r} is no epilogue contender; expected {EPILOGUE_KEY_FORM}")
    programs = found[6] and (DEVICE_SMS if found[6] == "sm" else int(found[6]))
    return EpilogueLaunch(config, programs, found[7] is not None)
