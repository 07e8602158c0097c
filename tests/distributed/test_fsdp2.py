"""FSDP2 (`fully_shard`) with the fused-linear loss: `whole_lm_head` gives the loss the whole lm_head and FSDP2 its
gradient. On 2 CPU ranks (gloo), with `fully_shard` on every layer and on the root, the ranks' losses and the full
gradients FSDP2 leaves in the shards are bit-identical (torch.equal, fp32 and bf16 parameters) to the same model
unsharded in one process: the loss on each rank's rows, and the mean of the two rows' gradients (FSDP2 averages over
ranks). Layouts: an untied biased lm_head, one tied to the input embedding (both held by the root, which FSDP2 keeps
unsharded from its forward to its backward), and an untied lm_head in its own `fully_shard` unit (sharded again after
its forward: `whole_lm_head` unshards it); accelerate's FSDP2 layout, which TRL uses (the head in a unit kept
unsharded after its forward), with the backward after the block as TRL runs it.
tests/workers/fsdp2_worker.py does the step."""

import pytest
import torch

from paths import WORKERS
from torchrun import run_worker

WORKER = WORKERS / "fsdp2_worker.py"
LAYOUTS = ("untied", "tied", "own_unit", "accelerate")
CASES = [(layout, dtype) for layout in LAYOUTS for dtype in ("torch.float32", "torch.bfloat16")]


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    """Rank 0's results of tests/workers/fsdp2_worker.py under torchrun, 2 CPU processes."""
    return run_worker(WORKER, tmp_path_factory.mktemp("fsdp2") / "fsdp2.pt")


@pytest.mark.parametrize("layout, dtype", CASES, ids=[f"{layout}-{dtype[6:]}" for layout, dtype in CASES])
def test_fsdp2_loss_and_gradients_equal_the_unsharded_model(cases, layout, dtype):
    case = cases[layout, dtype]
    reference = case["reference"]
    assert case["whole"] == ((96, 16), False, getattr(torch, dtype[6:]))  # a plain [V, D] tensor in the block
    assert case["outside_is_dtensor"] == (layout == "own_unit")  # only its own unit is resharded after forward
    assert case["after_is_dtensor"]  # sharded again once the backward is over
    assert torch.equal(case["losses"], reference["losses"])
    assert set(case["grads"]) == set(reference["grads"][0])
    assert ("lm_head.bias" in case["grads"]) == (layout != "tied")
    for name, grad in case["grads"].items():
        expected = (reference["grads"][0][name] + reference["grads"][1][name]) / 2
        assert expected.abs().max() > 0, f"{name} got no gradient"
        assert torch.equal(grad, expected), f"{name}: max difference {(grad - expected).abs().max()}"


def test_a_dtensor_weight_is_a_one_line_error(cases):
    for case in (cases[key] for key in CASES):
        assert "whole_lm_head" in case["sharded_error"] and "\n" not in case["sharded_error"]
    assert "no fully_shard (FSDP2) module holds it" in cases["unowned_dtensor_error"]

