"""Watch the Triton kernels a block of code launches: `JITFunction.run` (compiled) and `InterpretedFunction.run`
(TRITON_INTERPRET=1), each wrapped for the block and put back after it."""
from __future__ import annotations

import contextlib
from typing import Callable


def triton_launchers() -> tuple:
    """The classes whose `run` launches a Triton kernel: the compiled path's JITFunction and the interpreter's."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    return JITFunction, InterpretedFunction


@contextlib.contextmanager
def watched_launches(before: Callable[[object, tuple, dict], None]):
    """In the block, `before(kernel, args, kwargs)` is called ahead of each Triton kernel launch (warm-ups, which
    compile without launching, left out), then the kernel launches as it would have."""
    saved = [(launcher, launcher.run) for launcher in triton_launchers()]

    def watching(original):
        def run(kernel, *args, **kwargs):
            if not kwargs.get("warmup"):
                before(kernel, args, kwargs)
            return original(kernel, *args, **kwargs)
        return run

    for launcher, original in saved:
        launcher.run = watching(original)
    try:
        yield
    finally:
        for launcher, original in saved:
            launcher.run = original
