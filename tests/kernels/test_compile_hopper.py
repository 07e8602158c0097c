"""The logits path's kernels compile for sm_90 (H100/H200) with the Triton that CI installs (the fused path's:
test_compile_hopper_fused.py), and the compile helper refuses a kernel left without a constexpr."""
import re

import pytest

from compile_check import COMPILE_TIMEOUT_S, compile_for_hopper, run_compile_script
from erpo_kernels import triton_segment
from erpo_kernels.triton_logits import FORWARD_VARIANTS

# cpu_only (pytest.ini): a cross-compile on the CPU whatever the machine, with CI's Triton 3.6, the GPU image's;
# the GPU lease's tier leaves it out (bench/gpu_check.py, KERNEL_MARKS): there the CUDA tests compile every kernel
# they launch for the device, with the image's own ptxas
pytestmark = [pytest.mark.timeout(COMPILE_TIMEOUT_S), pytest.mark.cpu_only]


def test_a_kernel_is_not_compiled_without_all_its_constexprs():
    """triton.compile compiles a kernel whose signature leaves a constexpr out, the branches on it dropped (a missing
    WITH_SCORED_TARGETS went unnoticed so): compile_for_hopper refuses it, naming the parameter, before compiling."""
    signature = {"sample_ptr": "*i64", "kind_ptr": "*i64", "targets_ptr": "*i64", "spans_ptr": "*i64",
                 "num_rows": "i32", "num_samples": "i32"}
    with pytest.raises(ValueError, match=r"_sample_spans_kernel's constexpr parameters WITH_SCORED_TARGETS are not "
                                         r"given"):
        compile_for_hopper(triton_segment._sample_spans_kernel, signature,
                           {"HAS_KIND": True, "BLOCK": triton_segment.SPAN_BLOCK})


def test_logits_kernels_compile_for_hopper():
    out = run_compile_script("logits_compile_check.py")
    for dtype in ("bf16", "fp16", "fp32"):
        for kernel in ("forward", "backward", "forward-softcap", "backward-softcap"):  # bandwidth-bound row kernels:
            # a spill is a regression
            assert re.search(rf"compiled {kernel} {dtype} registers=\d+ spill_bytes=0\n", out), out
    assert "compiled segment_sum fp32" in out and "compiled sample-spans" in out
    variants = [(estimator, "ppo-clip") for estimator in ("k1", "k2", "k3", "k3-token")]
    variants += [("k3", objective) for objective in ("cispo", "sapo", "vespo")]
    for sequence in ("False", "True"):  # the objective's per-sample kernel, every option flag off and on
        for estimator, objective in variants:
            for flags, spans in (("False", "True"), ("True", "True"), ("True", "False")):
                assert re.search(rf"compiled objective-sample sequence={sequence} {estimator} {objective} "
                                 rf"flags={flags} spans={spans} registers=\d+ spill_bytes=0\n", out), out
    # the one-node loss's sample kernel with kernel 2 in its last program: four variants; with a sequence-level ratio
    # ptxas spills 4 bytes at 80 registers (Triton 3.6, 2026-11-26), immaterial in a kernel of one program a sample
    finished = re.findall(r"compiled objective-sample-finish .* sequence=(\w+) .* registers=\d+ spill_bytes=(\d+)\n",
                          out)
    assert len(finished) == 4 and all(spill == "0" or (sequence == "True" and int(spill) <= 8)
                                      for sequence, spill in finished), out
    for variant in FORWARD_VARIANTS:
        assert re.search(rf"compiled forward-variant {variant} bf16 registers=\d+ spill_bytes=0\n", out), out
        # with the soft-cap (not a bench case) the one-warp variants may spill a little: they must compile
        assert re.search(rf"compiled forward-variant {variant}-softcap bf16 registers=\d+ spill_bytes=\d+\n",
                         out), out
    for variant in ("shifted", "log2", "shifted-softcap", "log2-softcap"):
        for gradients in ("", "-coefficients"):  # given, or formed from the objective's coefficients (one node)
            assert re.search(rf"compiled backward-variant {variant}{gradients} bf16 registers=\d+ spill_bytes=0\n",
                             out), out
    for kernel in ("objective-finish", "objective-grad", "first-bad-row", "masked-quantile"):
        assert f"compiled {kernel}\n" in out, out
    if "nvdisasm None\n" in out:
        pytest.skip("no nvdisasm (neither $TRITON_NVDISASM_PATH nor Triton's own): every kernel compiled without a "
                    "spill, but the loops' SASS instructions per logit were not counted")
    # the forward loop's SASS instructions per logit, as launched on aligned bf16 rows: the base-2 loop about 10
    # (one max, one subtraction, one multiply, one floor, one exp2, one add, one FMA, the conversion; 10.3 and 9.6 on
    # 2026-11-26), under the ~14 a logit that an H200's bandwidth leaves (triton_logits' variants note); the shifted
    # one about 19 to 24
    per_logit = {name: float(value) for name, value in
                 re.findall(r"loop forward-variant (\S+) bf16 instructions_per_logit=([\d.]+)\n", out)}
    assert set(per_logit) == set(FORWARD_VARIANTS), out
    assert max(per_logit["log2-1024"], per_logit["log2-2048"]) <= 11 < min(per_logit["warp"], per_logit["warp-1024"])
    # 8 warps a row: the reductions cross warps (14.3 on 2026-11-26), still well under "block"'s 23.8
    assert per_logit["log2-block"] < 0.75 * per_logit["block"], out
    # the backward's: a logit's 4 bytes (read and written) leave about 28 instructions at an H200's bandwidth
    backward = {name: float(value) for name, value in
                re.findall(r"loop backward-variant (\S+) bf16 instructions_per_logit=([\d.]+)\n", out)}
    assert set(backward) == {"shifted", "log2"} and backward["log2"] <= 16 < backward["shifted"], out
