"""The logits-path kernels compile for sm_90 (H100/H200) with the Triton that CI installs."""
import re

from compile_check import run_compile_script


def test_logits_kernels_compile_for_hopper():
    out = run_compile_script("logits_compile_check.py")
    for dtype in ("bf16", "fp16", "fp32"):
        for kernel in ("forward", "backward", "forward-softcap", "backward-softcap"):  # bandwidth-bound row kernels:
            # a spill is a regression
            assert re.search(rf"compiled {kernel} {dtype} registers=\d+ spill_bytes=0\n", out), out
    assert "compiled segment_sum fp32" in out
