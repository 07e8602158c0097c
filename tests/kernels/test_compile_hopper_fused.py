"""The fused path's kernels compile for sm_90 (H100/H200) with the Triton that CI installs: a file of its own, beside
the logits path's (test_compile_hopper.py), so that a parallel run (pytest-xdist's loadfile) can run the two compile
scripts on two workers at once."""
import re

import pytest

from compile_check import COMPILE_TIMEOUT_S, run_compile_script

# cpu_only (pytest.ini): a cross-compile on the CPU whatever the machine, with CI's Triton 3.6, the GPU image's;
# the GPU lease's tier leaves it out (bench/gpu_check.py, KERNEL_MARKS): there the CUDA tests compile every kernel
# they launch for the device, with the image's own ptxas
pytestmark = [pytest.mark.timeout(COMPILE_TIMEOUT_S), pytest.mark.cpu_only]


def test_fused_kernels_compile_for_hopper():
    """Every Triton kernel the fused path launches, in each form it launches it (tests/workers/fused_compile_check.py),
    compiles for sm_90 without a spill: the chunks' row kernels on the fp32 logits buffer (the backward writing
    dlogits in each input dtype), d weight's hidden rows, the backward's scale passes (with bf16's rounding written
    out), the zero fill, and the objective's sample kernel (over every sample's span, and over a chunk's samples) and
    gradient kernel (d loss / d loss = 1, no pointer)."""
    out = run_compile_script("fused_compile_check.py")
    compiled = dict(re.findall(r"compiled (.+) registers=\d+ spill_bytes=(\d+)\n", out))
    expected = [f"chunk-forward{softcap}" for softcap in ("", "-softcap")]
    dtypes = ("bf16", "fp16", "fp32")
    expected += [f"chunk-backward{softcap} {dtype}" for softcap in ("", "-softcap") for dtype in dtypes]
    expected += [f"gradient-rows {dtype}" for dtype in dtypes]
    expected += ["scale bf16->bf16", "scale fp32->bf16", "scale fp16->fp16", "scale fp32->fp16", "scale fp32->fp32"]
    expected += ["zero-fill", "chunk-objective-grad"]
    expected += [f"chunk-objective-sample sequence={sequence} {variant} flags={on} sample_ids={chunk}"
                 for sequence in ("False", "True") for variant in ("k3 ppo-clip", "k3-token ppo-clip", "k1 vespo")
                 for on in ("False", "True") for chunk in ("False", "True")]
    assert sorted(compiled) == sorted(expected), out
    assert all(spill == "0" for spill in compiled.values()), out
