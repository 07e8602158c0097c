"""Triton's interpreter with its language patched once per kernel launch, not again at each device-function call.

Triton 3.6's interpreter patches triton.language (`_patch_lang`: every builtin of tl, tl.core, tl.math and
tl.tensor) when a kernel is launched and undoes it when the launch ends; it also runs `_patch_lang` at every call of
a @triton.jit device function inside the kernel, once per program of the grid. Inside a launch that second patch
changes nothing a kernel can see: the builtins are already patched (its scan of them, `inspect.getmembers` of four
modules, finds none left to patch), and the rest it sets again to closures that do the same as the launch's. The
scan was half the interpreter's time on a kernel of many small device functions (the loss's logits and objective
kernels), so CI, which runs every kernel in the interpreter, skips it where the launch has patched the modules the
function sees, and runs it as before anywhere else (a device function outside a launch, or one whose module sees a
language module the kernel's does not)."""
import inspect


def patch_lang_once_per_launch(monkeypatch) -> None:
    """Patch (through `monkeypatch`: pytest's fixture or a `pytest.MonkeyPatch`) Triton's interpreter so that a
    device-function call inside a launch skips `_patch_lang` when the launch has patched every language module the
    function's globals hold; the kernels compute the same values either way."""
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    def language_modules(fn) -> set[int]:
        """The ids of the language modules `_patch_lang(fn)` would patch (tl and tl.core, as fn's globals hold)."""
        return {id(value) for value in fn.__globals__.values()
                if inspect.ismodule(value) and (value is tl or value is tl.core)}

    launches: list[set[int]] = []   # the modules patched by each launch in progress (one at a time in practice)
    launch = interpreter.GridExecutor.__call__
    device_call = interpreter.InterpretedFunction.__call__

    def patched_launch(self, *args, **kwargs):
        launches.append(language_modules(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def patched_device_call(self, *args, **kwargs):
        if not launches:
            return device_call(self, *args, **kwargs)
        modules = language_modules(self.fn)
        if not modules <= launches[-1]:   # e.g. tl.core, which tl.sum and the like see: patched here, as Triton does
            interpreter._patch_lang(self.fn)   # (and, as there, not undone: a later call needs no new patch)
            launches[-1] |= modules
        fn = self.rewrite()   # the rest of InterpretedFunction.__call__
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", patched_launch)
    monkeypatch.setattr(interpreter.InterpretedFunction, "__call__", patched_device_call)
