"""DeepSpeed ZeRO-3 with the fused-linear loss: `whole_lm_head` (`gathered_lm_head` at ZeRO-3) gives the loss the whole
lm_head and DeepSpeed its gradient. One SGD step on 2 CPU ranks (gloo) under ZeRO-3 equals the same step under
ZeRO-0, for an untied biased lm_head and for an lm_head tied to the input embedding (tests/workers/zero3_worker.py does
the step)."""
import pytest
import torch

from erpo_kernels.lm_head import whole_lm_head
from paths import WORKERS
from torchrun import run_worker

WORKER = WORKERS / "zero3_worker.py"


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """Rank 0's results by ZeRO stage (0, then 3, in one torchrun job) and by tied."""
    pytest.importorskip("deepspeed", exc_type=ModuleNotFoundError)
    return run_worker(WORKER, tmp_path_factory.mktemp("zero3") / "steps.pt", "--zero-stages", "0", "3")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_zero3_step_matches_zero0(steps, tied):
    zero0, zero3 = steps[0][tied], steps[3][tied]
    assert zero3["shard_numel"] == 0 < zero0["shard_numel"]  # the problem the helper solves
    assert "whole_lm_head" in zero3["shard_error"]  # passing the shard itself is a clear error
    assert zero3["gathered_shape"] == zero0["gathered_shape"] == (96, 16)
    torch.testing.assert_close(zero3["loss"], zero0["loss"], rtol=1e-6, atol=1e-6)
    assert set(zero3["params"]) == set(zero0["params"])
    assert ("lm_head.bias" in zero0["params"]) == (not tied)
    for name, expected in zero0["params"].items():
        moved = (expected - zero0["initial"][name]).abs().max()
        assert moved > 1e-4, f"{name} did not change in the step"
        torch.testing.assert_close(zero3["params"][name], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_backward_after_the_block_is_an_error_under_zero3(steps):
    assert steps[0][False]["backward_outside_error"] == ""
    assert "gathered_lm_head" in steps[3][False]["backward_outside_error"]


def test_without_deepspeed_the_helper_yields_the_head_as_is():
    head = torch.nn.Linear(8, 20)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = head

        def get_output_embeddings(self):
            return self.lm_head

    for module in (head, Model()):
        with whole_lm_head(module) as (weight, bias):
            assert weight is head.weight and bias is head.bias
    with pytest.raises(TypeError, match="get_output_embeddings"):
        with whole_lm_head(torch.nn.ReLU()):
            pass
