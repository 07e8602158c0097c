"""The fused path's bf16 d hidden is the fp32 product of its operands rounded once, on CUDA's cuBLAS too (issue 32).

`fused_linear_loss.GradientGroups.close_group` forms a group's d hidden [G, D] with one GEMM, dlogits [G, V] @
weight [V, D], whose output is in hidden's dtype by default, in fp32 with `GRAD_HIDDEN_FP32` (then held in fp32 until
the backward's scale pass rounds it once). Held in hidden's dtype, d hidden is rounded twice whenever the incoming
gradient is not 1 (a trainer's loss / gradient-accumulation steps): by the GEMM, then by the scale pass;
`test_fp32_dhidden_is_the_product_rounded_once` shows that on the CPU, and that the fp32 path rounds once. For a
bf16 output cuBLAS may split the sum over K = V across thread
blocks, and while `torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction` is True (PyTorch's default) it
may add the partial sums in the output's type: bf16 (PyTorch's notes/cuda.rst, "Reduced Precision Reduction in BF16
GEMMs"; PyTorch's cuBLAS path then leaves out CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION, its cuBLASLt path
the reduction-scheme mask). Set False, the partials are added in fp32 and split-K stays allowed (since torch 2.10 the
setting is the pair (reduced precision, split-K); (False, False) forbids split-K and needs the cuBLASLt backend). A
[G, D] output with K = 152064 and few output tiles, a small call or a call's last group, is where cuBLAS splits K,
and it did: on the H200 lease of 2026-11-26 (commit 2ab6bb9, torch 2.11.0+cu130, N = 16384 in 16 chunks of 1024
rows, each its own group; bench/measured/h200-2026-11-26-profiles/fused_profile.md) 14 of the call's 16 d hidden GEMMs
ran `nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_splitK_NNT`, each followed by `cublasLt::splitKreduce_kernel<32, 16,
int, float, __nv_bfloat16, float, __nv_bfloat16, false, float, ...` (the name cut there). Its type arguments suggest
fp32 partial sums rounded once, which a kernel's name cannot prove: this test measures it. The logits GEMM and
d weight's accumulation (`_accumulate_product`) write fp32 and are not concerned.

The bound (`rounding_check`). The K products of two bf16 numbers are exact in fp32 and float64; s is their exact sum
(float64: K = 152064 terms off by at most K 2^-53 of sum_k |a_k b_k|, nothing beside what follows) and r = s rounded
to bf16 once. A GEMM that sums in fp32 in any order gets s' with |s' - s| <= e, then rounds once: rounding is
monotone and moves a value by at most half an ulp, so |rnd(s') - r| <= e + 1 ulp (the ulp of the larger of the two,
which covers a binade's edge). e, the fp32 sum's own error, is at most (K - 1) 2^-24 sum_k |a_k b_k| in the worst
order, but its rounding errors take both signs: Higham and Mary's probabilistic bound lambda sqrt(K) 2^-24 sum_k
|a_k b_k|, with lambda = 10 (failing with probability under 2 K e^(-lambda^2 / 2), 1e-16, per element), is 2^-12.1
of the sum for K = 152064. We allow twice that, e = 2^-11 sum_k |a_k b_k| (SLACK), so every element must satisfy
|d hidden - r| <= 1 ulp + SLACK sum_k |a_k b_k|. Tensor cores that truncate where they align their addends may err
in one direction, which that bound does not model: so the test holds cuBLAS's fp32-output product of the same
operands, rounded once, to the same bound (the control); should the control fail, the bound is wrong for this GPU,
not d hidden. A bf16 split-K reduction rounds each partial sum P_i to bf16 (half an ulp of P_i), far more than SLACK
of the sum where the partials cancel (d hidden's terms are softmax minus the target's one-hot times the weight's rows:
a few large terms anywhere in the vocabulary); the first test below shows that the bound rejects even its mildest
form (the bf16 partials then added in fp32 and the total rounded once) and passes one rounding of an fp32 product.

Where the numbers show. The GPU lease's kernel tier (bench/gpu_check.py) runs pytest with -rfE, which prints a
failure's message but not what a passing test printed; so a passing case reports its numbers as a `RoundingReport`
warning, which pytest's warnings summary prints (kernel-tests.log keeps both). On the CPU the test skips: the
question is cuBLAS's, and the interpreter at V = 152064 would take minutes. Its cases run both ways of d hidden, so
that the lease reports the fp32 path beside today's (bench/README.md: how the next session picks the default).

Its cost in the GPU tier: 16 cases, each one fused call on a bf16 [V, D] lm_head (1.1 GB at D = 3584; no d weight is
asked for, so no fp32 accumulator) and two float64 GEMMs of the group's shape in vocabulary slices (under 2 GB at a
time); under 4 GB of GPU memory at a time (the weight, the 1 GiB workspace, the float64 slices), and seconds a case,
the first one compiling the row kernels for V = 152064 (an estimate from the shapes, not measured: no GPU lent this
session). It sorts early among the files that follow KERNEL_FILES_FIRST, so it starts in the tier's first wave.
"""
import contextlib
import os
import warnings
from dataclasses import dataclass

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton` (also done by conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402

import erpo_kernels.fused_linear_loss as chunked  # noqa: E402
from erpo_kernels import fused_linear_erpo_loss  # noqa: E402
from test_fused_linear_loss import (  # noqa: E402
    ROW_TENSORS,
    SAMPLES,
    budget_for_groups,
    leaves,
    linear,
    packed_batch,
)

SLACK = 2.0 ** -11          # the fp32 sum's error allowed, as a share of sum_k |a_k b_k| (module docstring)
VOCAB = 152064              # Qwen2.5-7B's lm_head (and 14B to 72B); the 0.5B's 151936 is the same K
LOGIT_STD = 4.0             # the logits' spread: a peaked softmax, a few large terms in each d hidden element
SAMPLE_ROWS = (7, 8)        # each sample's query and response rows (and one padding row: 16 rows a sample)
# (rows, D): one group each in the default 1 GiB workspace (`fused_linear_loss.plan_workspace`): 64, 512 and 1024
# rows, dlogits over their logits, few output tiles (1024 x 3584: the GEMM cuBLAS split on the H200, above); 2048
# rows, the full group bf16 Qwen2.5-7B gets in chunks of 512 beside a store of their dlogits
SHAPES = {"64x896": (64, 896), "512x3584": (512, 3584), "1024x3584": (1024, 3584), "2048x3584": (2048, 3584)}
# allow_bf16_reduced_precision_reduction during the call: as the process has it (PyTorch's default True), or False
REDUCTIONS = {"default": None, "fp32-reduction": False}
FLOAT64_SLICE = 16384       # vocabulary rows per float64 GEMM of the oracle (memory: 0.5 GB of float64 at D = 3584)
# d hidden held in hidden's dtype (the library's default) or in fp32 until the backward rounds it
# (fused_linear_loss.GRAD_HIDDEN_FP32)
PATHS = {"dhidden-as-hidden": False, "dhidden-fp32": True}
# d loss / d loss: loss.backward()'s 1, and a trainer's 1 / gradient-accumulation steps, here 0.37, which makes the
# backward's scale pass round d hidden a second time where the GEMM rounded it first
FACTORS = (1.0, 0.37)


class RoundingReport(UserWarning):
    """A passing case's measured error: the GPU tier's pytest (-rfE) prints warnings, not a passing test's output."""


@dataclass(frozen=True)
class RoundingCheck:
    """`rounding_check`'s findings on a [m, n] bf16 result: the largest error in bf16 ulps of the float64 product
    rounded once, how many of the elements break the bound (1 ulp + SLACK sum_k |a_k b_k|) and the largest
    error as a share of that bound."""

    max_ulps: float
    beyond: int
    elements: int
    worst_of_bound: float

    def __str__(self) -> str:
        return (f"max {self.max_ulps:.0f} ulp, {self.beyond} of {self.elements} beyond the bound "
                f"(worst {self.worst_of_bound:.2f} of it)")


def bf16_ulp(magnitude: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers (8 significant bits) at each magnitude >= 0 (float64, any shape): 2^(e - 8) for
    a magnitude in [2^(e - 1), 2^e); 2^-133, the subnormals' spacing, below 2^-126."""
    _, exponent = torch.frexp(magnitude)
    spacing = torch.ldexp(torch.ones_like(magnitude), exponent - 8)
    return torch.where(magnitude < 2.0 ** -126, torch.full_like(magnitude, 2.0 ** -133), spacing)


def float64_products(a: torch.Tensor, b: torch.Tensor):
    """(a @ b, |a| @ |b|) [m, n] float64 of a [m, K] and b [K, n], in slices of FLOAT64_SLICE along K (bounded
    memory). The products of bf16 numbers are exact in float64, their sum off by at most K 2^-53 of the second."""
    exact = a.new_zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    magnitude = torch.zeros_like(exact)
    for start in range(0, a.shape[1], FLOAT64_SLICE):
        part = slice(start, start + FLOAT64_SLICE)
        a_part, b_part = a[:, part].double(), b[part].double()
        exact += a_part @ b_part
        magnitude += a_part.abs() @ b_part.abs()
    return exact, magnitude


def rounding_check(result: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor) -> RoundingCheck:
    """result [m, n] bf16 against the float64 product `exact` rounded once to bf16, with `magnitude` = sum_k
    |a_k b_k| [m, n] (`float64_products`): the bound is one ulp plus SLACK of the magnitude (module docstring)."""
    rounded, ours = exact.to(torch.bfloat16).double(), result.double()
    ulp = bf16_ulp(torch.maximum(rounded.abs(), ours.abs()))
    error = (ours - rounded).abs()
    bound = ulp + SLACK * magnitude
    return RoundingCheck(float((error / ulp).max()), int((error > bound).sum()), error.numel(),
                         float((error / bound).max()))


def one_rounding_bounds(exact: torch.Tensor, magnitude: torch.Tensor, terms: int, dtype: torch.dtype):
    """(low, high) in `dtype`: what an fp32 sum of `terms` products, exact in fp32, then one fp32 product, can give
    once rounded to dtype, where `exact` [m, n] float64 is the value and `magnitude` its sum_k |a_k b_k| (both
    already times the factors). Each fp32 addition errs by at most 2^-24 of a partial sum (twice that allowed, for
    tensor cores that truncate), so the sum by at most terms 2^-23 of the magnitude, the product by 2^-24 of the
    value: e = (terms + 1) 2^-23 magnitude; rounding is monotone, so the result lies in [rnd(exact - e),
    rnd(exact + e)], one value where no rounding boundary is within e of `exact`."""
    error = (terms + 1) * 2.0 ** -23 * magnitude
    return (exact - error).to(dtype), (exact + error).to(dtype)


def recorded_groups(monkeypatch) -> list:
    """[(rows, dlogits, fp16 scale)] of every group the fused loss closes from now on, as its d hidden GEMM reads
    them (the dlogits cloned before the GEMM runs)."""
    groups = []
    close_group = chunked.GradientGroups.close_group

    def recording(self):
        groups.append((self.rows, self.dlogits.clone(), self.scale))
        close_group(self)

    monkeypatch.setattr(chunked.GradientGroups, "close_group", recording)
    return groups


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_dhidden_is_the_product_rounded_once(dtype, factor, device, monkeypatch):
    """The fused loss on a small lm_head (V = 300) in chunks of 4 rows, groups of 16, (loss * factor).backward():
    with GRAD_HIDDEN_FP32, hidden.grad is the float64 product of each group's dlogits and the weight (over its fp16
    scale), times the fp32 factor, rounded once: within `one_rounding_bounds` everywhere. With d hidden held in
    hidden's dtype it is rounded twice when factor != 1 (the GEMM's output, then the scale pass), which puts some
    elements outside them (on the CPU at factor 0.37: 226 of the 1560 in bf16, 114 in fp16; the bounds are one value
    for all but 61 and 149 of them); at factor 1 the CPU's GEMM rounds once too."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 4)
    groups = recorded_groups(monkeypatch)
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), dtype, device)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    scale = torch.tensor(factor, dtype=torch.float32, device=device)  # the incoming gradient, fp32 as autograd's
    outside = {}
    for path, fp32 in PATHS.items():
        monkeypatch.setattr(chunked, "GRAD_HIDDEN_FP32", fp32)
        groups.clear()
        hidden, weight, bias = leaves(*tensors)
        loss = fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="triton",
                                      workspace_bytes=budget_for_groups(4, 16, dtype, device), qkl_coef=0.5,
                                      **inputs).loss
        (loss * scale).backward()
        assert len(groups) > 1  # groups of 16 rows at most (fp16's are cut where the chunks' scales differ)
        exact, magnitude = (torch.zeros(hidden.shape, dtype=torch.float64, device=device) for _ in range(2))
        for rows, dlogits, fp16_scale in groups:
            exact[rows], magnitude[rows] = (product / fp16_scale for product in float64_products(dlogits, weight))
        low, high = one_rounding_bounds(exact * scale.double(), magnitude * scale.double(), weight.shape[0], dtype)
        assert hidden.grad.dtype == dtype
        outside[path] = int(((hidden.grad < low) | (hidden.grad > high)).sum())
    assert outside["dhidden-fp32"] == 0, outside
    if factor != 1:
        assert outside["dhidden-as-hidden"] > 0, outside


@contextlib.contextmanager
def bf16_reduction(allowed):
    """torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = allowed inside the block (None: as it
    is), restored after, with the split-K half of the setting (torch >= 2.10) as it was."""
    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction_split_k)
    if allowed is not None:
        matmul.allow_bf16_reduced_precision_reduction = allowed
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def cublas_setting() -> str:
    """The GEMM settings that decide how cuBLAS may reduce a bf16 GEMM, with the torch version and the GPU."""
    matmul = torch.backends.cuda.matmul
    return (f"allow_bf16_reduced_precision_reduction={matmul.allow_bf16_reduced_precision_reduction}, "
            f"split_k={matmul.allow_bf16_reduced_precision_reduction_split_k}, "
            f"blas={torch.backends.cuda.preferred_blas_library().name}, torch {torch.__version__}, "
            f"{torch.cuda.get_device_name()}")


def test_the_check_tells_one_rounding_from_a_bf16_split_k_reduction(device):
    """On a loss-like dlogits (softmax of logits of spread LOGIT_STD minus the target's one-hot) and a random weight:
    the fp32 product rounded once passes `rounding_check`; a split-K reduction whose partial sums are rounded to bf16
    fails it, even in its mildest form (the bf16 partials added in fp32, the total rounded once)."""
    g = torch.Generator().manual_seed(0)
    rows, vocab, width = 64, 32768, 64
    # drawn on the CPU (the same numbers on every device), then moved
    probs = torch.softmax(torch.randn(rows, vocab, generator=g, device="cpu") * LOGIT_STD, dim=1)
    targets = torch.randint(0, vocab, (rows,), generator=g, device="cpu")
    dlogits = (probs - torch.nn.functional.one_hot(targets, vocab)).to(device, torch.bfloat16)
    weight = torch.randn(vocab, width, generator=g).to(device, torch.bfloat16)
    exact, magnitude = float64_products(dlogits, weight)
    once = rounding_check((dlogits.float() @ weight.float()).bfloat16(), exact, magnitude)
    assert once.beyond == 0 and once.max_ulps <= 1, once
    for splits in (2, 8):
        step = vocab // splits
        partials = [dlogits[:, start:start + step].float() @ weight[start:start + step].float()
                    for start in range(0, vocab, step)]
        split_k = rounding_check(sum(partial.bfloat16().float() for partial in partials).bfloat16(), exact, magnitude)
        assert split_k.beyond > 0, (splits, split_k)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_dhidden_is_the_fp32_product_rounded_once(shape, reduction, path, device, monkeypatch):
    """bf16 hidden and lm_head at V = 152064, one group of `shape`'s rows, `fused_linear_erpo_loss` fwd+bwd with
    allow_bf16_reduced_precision_reduction as the process has it and False, d hidden held in bf16 and in fp32
    (GRAD_HIDDEN_FP32): hidden.grad within one ulp plus SLACK of the float64 product of the group's own dlogits (the
    operand its d hidden GEMM read) and the weight, rounded once; the same for cuBLAS's fp32-output product rounded
    once (the control). Reports both (RoundingReport)."""
    if device.type != "cuda":
        pytest.skip("cuBLAS's split-K reduction of a bf16 GEMM is the GPU's question; the CPU has no cuBLAS")
    rows, hidden_dim = SHAPES[shape]
    monkeypatch.setattr(chunked, "GRAD_HIDDEN_FP32", PATHS[path])
    groups = recorded_groups(monkeypatch)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(rows, hidden_dim, generator=g, device=device).to(torch.bfloat16).requires_grad_(True)
    # scaled in place (one fp32 copy of the weight at a time: 2.2 GB at D = 3584); no gradient asked of it, d weight's
    # fp32 accumulator not being concerned
    weight = torch.randn(VOCAB, hidden_dim, generator=g, device=device).mul_(LOGIT_STD / hidden_dim ** 0.5).to(
        torch.bfloat16)
    batch = packed_batch([SAMPLE_ROWS] * (rows // (sum(SAMPLE_ROWS) + 1)), device, vocab=VOCAB)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    with bf16_reduction(REDUCTIONS[reduction]):
        setting = cublas_setting()
        fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), **inputs).loss.backward()
    assert [group_rows for group_rows, _, _ in groups] == [slice(0, rows)]  # one group: the GEMM of `shape`
    dlogits = groups[0][1]
    exact, magnitude = float64_products(dlogits, weight)
    ours = rounding_check(hidden.grad, exact, magnitude)
    control = rounding_check(torch.mm(dlogits, weight, out_dtype=torch.float32).bfloat16(), exact, magnitude)
    report = (f"{shape} rows x D, {reduction}, {path}: d hidden {ours}; the fp32 GEMM rounded once {control}; "
              f"{setting}")
    assert (ours.beyond, control.beyond) == (0, 0), report
    warnings.warn(RoundingReport(report))
