"""Triton's interpreter held to what the GPU image does, so that CPU CI fails where a GPU run would.

- numpy: Triton 3.6's interpreter takes int() of 1-element arrays where a kernel loops over `range` of a run-time
  bound; numpy >= 1.25 warns (DeprecationWarning), the GPU image's numpy 2.5 raises TypeError, which broke every such
  kernel under TRITON_INTERPRET=1 there. The kernel tier turns that warning into an error: NUMPY_SCALAR_ERROR, a
  filter in the form both pytest's filterwarnings and PYTHONWARNINGS (for the processes its tests start) read.
- NaN in min / max: compiled, tl.minimum / tl.maximum without propagate_nan return the non-NaN operand (PTX
  min/max.f32); the interpreter's numpy returns NaN. `min_max_drop_nan_as_compiled` makes the interpreter drop it
  too (np.fmin / np.fmax), so a clamp that loses a NaN fails on CPU as it does on a GPU.
- FMA contraction: compiled (Triton's enable_fp_fusion, on by default), an fp32 product that feeds an add or a
  subtraction is fused with it into one FMA, rounded once: x * k - m * k at x = m is then the rounding error of m * k,
  not 0. `fma_contraction_as_compiled` makes the interpreter do the same, for the tests of what must be exact.
- fp32 -> bf16: compiled, a cast (and a store of an fp32 value through a bf16 pointer) rounds to the nearest bf16,
  ties to even (LLVM's fptrunc, PTX cvt.rn.bf16.f32), as torch's `.to(torch.bfloat16)`; Triton 3.6's interpreter cuts
  the low 16 bits off (rounds toward zero): up to one bf16 ulp (2^-7 relative) below the value and biased toward zero,
  where the compiled kernel is within half an ulp. `bf16_rounding_as_compiled` makes the interpreter round to nearest
  even, so a bf16 output (a d logits) is checked against the precision the GPU gives (tests/kernels/
  test_model_families.py's one-ulp bounds failed on the truncation, 2026-11-27).
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


def fma_contraction_as_compiled(monkeypatch) -> None:
    """Patch (through `monkeypatch`) the interpreter's fp32 multiply to keep its exact product (in float64, exact for
    fp32 operands) and its add / subtract to use it, as one FMA: round(a * b + c) from the exact a * b, as LLVM
    contracts them for the GPU (when both operands are products, the left one, as the DAG combiner tries first:
    x * k - m * k became fma(x, k, -(m * k)) in the base-2 loop's PTX, 2026-11-26). A product that passes through
    any other operation (a select, a max, a broadcast, a reduction, memory) is a plain fp32 value again, as the
    compiled code's (its select keeps a product apart from a subtraction). Rounding twice (float64, then fp32) may
    differ from an FMA's one rounding in the last bit; exact zeros and their absence are what it shows."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def multiply(self, lhs, rhs):
        out = self.binary_op(lhs, rhs, np.multiply)
        if out.data.dtype == np.float32:
            with np.errstate(invalid="ignore"):  # 0 * inf: the fp32 product above has warned of it
                out.attr["exact_product"] = lhs.data.astype(np.float64) * rhs.data.astype(np.float64)
        return out

    def contracted(op):
        def create(self, lhs, rhs):
            left, right = lhs.attr.get("exact_product"), rhs.attr.get("exact_product")
            if left is None and right is None:
                return self.binary_op(lhs, rhs, op)
            operands = (left, rhs.data.astype(np.float64)) if left is not None else (lhs.data.astype(np.float64), right)
            return TensorHandle(op(*operands).astype(np.float32), lhs.dtype.scalar)
        return create

    monkeypatch.setattr(InterpreterBuilder, "create_fmul", multiply)
    monkeypatch.setattr(InterpreterBuilder, "create_fadd", contracted(np.add))
    monkeypatch.setattr(InterpreterBuilder, "create_fsub", contracted(np.subtract))


def round_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 `values` rounded to the nearest bf16, ties to even, as uint16 bit patterns (the interpreter's storage of
    bf16): the fp32 bits plus 0x7FFF plus the kept part's lowest bit, shifted down 16 (a carry into the exponent is
    the right rounding, up to inf); a NaN stays a quiet NaN of its sign."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), ((bits >> 16) | 0x0040).astype(np.uint16), rounded)


def bf16_rounding_as_compiled(monkeypatch) -> None:
    """Patch (through `monkeypatch`) the interpreter's fp32 -> bf16 cast, which truncates, to round to nearest even
    as the compiled cast does (`round_to_bf16_bits`); every other cast is the interpreter's own."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    truncating = InterpreterBuilder.cast_impl

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(round_to_bf16_bits(src.data), dst_type.scalar)
        return truncating(self, src, dst_type)

    monkeypatch.setattr(InterpreterBuilder, "cast_impl", cast)
