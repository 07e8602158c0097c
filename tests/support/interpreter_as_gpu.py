"""Triton's interpreter held to what the GPU image does, so that CPU CI fails where a GPU run would.

- numpy: Triton 3.6's interpreter takes int() of 1-element arrays where a kernel loops over `range` of a run-time
  bound; numpy >= 1.25 warns (DeprecationWarning), the GPU image's numpy 2.5 raises TypeError, which broke every such
  kernel under TRITON_INTERPRET=1 there. The kernel tier turns that warning into an error: NUMPY_SCALAR_ERROR, a
  filter in the form both pytest's filterwarnings and PYTHONWARNINGS (for the processes its tests start) read.
- NaN in min / max: compiled, tl.minimum / tl.maximum without propagate_nan return the non-NaN operand (PTX
  min/max.f32); the interpreter's numpy returns NaN. `min_max_drop_nan_as_compiled` makes the interpreter drop it
  too (np.fmin / np.fmax), so a clamp that loses a NaN fails on CPU as it does on a GPU.
"""
import numpy as np

NUMPY_SCALAR_ERROR = "error:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"


def min_max_drop_nan_as_compiled(monkeypatch) -> None:
    """Patch (through pytest's `monkeypatch`, undone after the test) the interpreter's tl.minimum / tl.maximum with
    the default propagate_nan=NONE to drop a NaN operand as the compiled kernels do; propagate_nan=ALL keeps
    numpy's NaN-propagating np.minimum / np.maximum."""
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_minnumf", lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin))
    monkeypatch.setattr(InterpreterBuilder, "create_maxnumf", lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax))
