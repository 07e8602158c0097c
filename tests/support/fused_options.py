"""The suite's `--fused-options KEYS` (tests/conftest.py): the fused loss's private knobs set for a whole test session,
so that a candidate default (issue 32: EPILOGUE_ROW_PASS with a config and launch, GRAD_HIDDEN_FP32, a chunk geometry)
is proven by every test of the fused path before it is flipped, not by its own tests alone.

KEYS are the bench's contender keys that set those knobs, comma-separated, the ones a GPU lease's bench 1 times and
picks (bench/README.md, "The probe's pick", "The epilogue probe's pick"): `erpo-dh32` (GRAD_HIDDEN_FP32), `erpo-epi`
(EPILOGUE_ROW_PASS at the library's config and launch), `erpo-epi-BMxBNxBK-wW-sS[-persistentP|-persistentsm][-tma]` (it
with the bf16 / fp16 config and the launch the key names; -persistentsm: one program per SM of the device, the library's
form of a persistent launch, three programs in the interpreter), `erpo-geom-ROWS[-GROUP]` (LOGITS_ROWS, GROUP_ROWS).
Each key's knobs are its contender's (`bench.contenders`: the same settings as the lease's rows), entered in the order
given, so a later key's setting wins where two set one constant. A test that sets a constant itself (monkeypatch) still
does so; it gets the session's value back after it.
"""
from __future__ import annotations

import contextlib
from typing import List


def knob_contenders(keys: str) -> List:
    """The `bench.contenders.Contender`s that `keys` ("erpo-dh32,erpo-geom-256-2304", "" for none) names, in order;
    ValueError (one line naming the key and the keys accepted) for a key that is no fused contender setting knobs."""
    from bench.contenders import CONTENDERS, KEY_RULES, select

    names = [key.strip() for key in keys.split(",") if key.strip()]
    settable = [c.key for c in CONTENDERS if c.path == "fused" and c.knobs is not contextlib.nullcontext]
    for key in names:
        rule = next((parse for is_ruled, parse, _, _ in KEY_RULES if is_ruled(key)), None)
        if rule is None and key not in settable:
            forms = " or ".join(form for *_, form in KEY_RULES)
            raise ValueError(f"--fused-options: {key!r} sets no fused-loss knob; give {', '.join(settable)} or {forms}")
        if rule is not None:
            try:
                rule(key)
            except ValueError as error:
                raise ValueError(f"--fused-options: {error}") from None
    chosen = {contender.key: contender for contender in select(names, ("fused",))}
    return [chosen[key] for key in names]


def enter_knobs(keys: str, stack: contextlib.ExitStack) -> List[str]:
    """Enter the knobs of every key in `keys` (`knob_contenders`) on `stack`, which puts them back when it closes;
    returns the contenders' labels (what each sets)."""
    contenders = knob_contenders(keys)
    for contender in contenders:
        stack.enter_context(contender.knobs())
    return [contender.label for contender in contenders]
