"""The suite's `--fused-options` (tests/support/fused_options.py): the bench's contender keys set the fused loss's
knobs for a session, in the order given, and put them back; a key that sets none is a one-line error."""
import contextlib

import pytest

from erpo_kernels import fused_linear_loss, triton_logits_gemm
from fused_options import enter_knobs


def knobs():
    return (fused_linear_loss.EPILOGUE_ROW_PASS, fused_linear_loss.GRAD_HIDDEN_FP32, fused_linear_loss.LOGITS_ROWS,
            fused_linear_loss.GROUP_ROWS, dict(triton_logits_gemm.LOSS_CONFIGS), triton_logits_gemm.LOSS_LAUNCH)


def test_the_keys_set_their_contenders_knobs_and_put_them_back():
    library = knobs()
    with contextlib.ExitStack() as stack:
        labels = enter_knobs(" erpo-dh32, erpo-epi-32x64x16-w4-s2-persistent7-tma,erpo-geom-256-2304", stack)
        epilogue, fp32, rows, group, configs, launch = knobs()
        assert (epilogue, fp32, rows, group) == (True, True, 256, 2304)
        assert configs[(2, False)] == triton_logits_gemm.GemmConfig(32, 64, 16, 4, 2)
        assert {key: config for key, config in configs.items() if key != (2, False)} == {
            key: config for key, config in library[4].items() if key != (2, False)}
        assert launch == triton_logits_gemm.Launch(7, True)
        assert len(labels) == 3 and "GRAD_HIDDEN_FP32=True" in labels[0] and "LOGITS_ROWS=256" in labels[2]
    assert knobs() == library
    with contextlib.ExitStack() as stack:  # a later key wins where two set one constant
        enter_knobs("erpo-geom-512-1536,erpo-geom-384", stack)
        assert (fused_linear_loss.LOGITS_ROWS, fused_linear_loss.GROUP_ROWS) == (384, None)
    with contextlib.ExitStack() as stack:
        assert enter_knobs("", stack) == [] and knobs() == library


@pytest.mark.parametrize("keys,message", [
    ("erpo-ws2g", r"^--fused-options: 'erpo-ws2g' sets no fused-loss knob; give erpo-dh32, erpo-epi or erpo-geom-"),
    ("erpo-dh32,erpo-log2", r"^--fused-options: 'erpo-log2' sets no fused-loss knob"),
    ("erpo-geom-256-1000", r"^--fused-options: 'erpo-geom-256-1000' is no geometry contender; expected erpo-geom-"),
    ("erpo-epi-100x64x16-w4-s2", r"^--fused-options: 'erpo-epi-100x64x16-w4-s2' is no epilogue contender"),
])
def test_a_key_that_sets_no_knob_is_refused_in_one_line(keys, message):
    library = knobs()
    with contextlib.ExitStack() as stack, pytest.raises(ValueError, match=message) as refused:
        enter_knobs(keys, stack)
    assert "\n" not in str(refused.value) and knobs() == library
