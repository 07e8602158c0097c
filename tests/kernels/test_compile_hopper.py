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
    variants = [(estimator, "ppo-clip") for estimator in ("k1", "k2", "k3", "k3-token")]
    variants += [("k3", objective) for objective in ("cispo", "sapo", "vespo")]
    for sequence in ("False", "True"):  # the objective's per-sample kernel, every option flag off and on
        for estimator, objective in variants:
            for flags in ("False", "True"):
                assert re.search(rf"compiled objective-sample sequence={sequence} {estimator} {objective} "
                                 rf"flags={flags} registers=\d+ spill_bytes=0\n", out), out
    for variant in ("block", "warp", "warp-1024"):
        assert re.search(rf"compiled forward-variant {variant} bf16 registers=\d+ spill_bytes=0\n", out), out
    for kernel in ("objective-finish", "objective-grad", "first-bad-row", "masked-quantile"):
        assert f"compiled {kernel}\n" in out, out
