"""One optimizer step of `erpo train` split over 2 ranks (gloo, tests/workers/step_split_worker.py) and over
micro-batches on each gives the gradient and the metrics of the whole step in one process and one call."""
import pytest
import torch

from paths import WORKERS
from step_split import CASES, COMPARED_METRICS, GROUP_2_FILTERED, rollout, step_gradient
from torchrun import run_worker


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_worker(WORKERS / "step_split_worker.py", tmp_path_factory.mktemp("step_split") / "out.pt")


@pytest.mark.parametrize("case", [*CASES, "group-2-filtered"])
def test_two_uneven_ranks_give_the_gradient_and_metrics_of_the_whole_step(two_ranks, case):
    """Rank 0 holds 4 samples and rank 1 2 (truncated ones: with mask_truncated rank 1 scores no response token;
    with group 2 filtered it runs stand-ins only), in micro-batches of 1 and 3: the averaged gradient (DeepSpeed's
    reduction) and every logged mean are the one-process step's, for every loss aggregation the trainer offers.
    The normalizers are global and each rank's loss is scaled by the world size; the metrics are reduced over
    ranks, not rank 0's."""
    overrides, keep = ([], GROUP_2_FILTERED) if case == "group-2-filtered" else (CASES[case], (True,) * 6)
    whole_grad, whole_record = step_gradient(overrides, 6, rollout(keep=keep))
    assert whole_grad.norm() > 0
    for key in (k for k in two_ranks if k.split("/")[0] == case and k != "deepspeed-zero2"):
        grad, record = two_ranks[key]
        torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
        for name in COMPARED_METRICS:
            assert record[name] == pytest.approx(whole_record[name], rel=1e-5, abs=1e-7), f"{key}: {name}"


def test_deepspeed_accumulates_and_reduces_the_step_as_one_process(two_ranks):
    """The same uneven 2-rank step (micro-batches of 1: rank 1 runs 2 stand-ins) through erpo's DeepSpeedUpdater at
    ZeRO-2, whose gradients DeepSpeed accumulates over the micro-batches and averages over the ranks: the global
    gradient norm it reports (before clipping) is the one-process step's (a loss scaled by the world size twice,
    or not at all, would be off by 2)."""
    whole_grad, _ = step_gradient(CASES["seq-mean-token-sum"], 6, rollout())
    assert two_ranks["deepspeed-zero2"] == pytest.approx(whole_grad.norm().item(), rel=1e-5)
