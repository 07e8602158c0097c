"""One optimizer step of `erpo train` split over micro-batches (gradient accumulation) gives the gradient and the
metrics of the same step in one call, for every loss aggregation the trainer offers (tests/support/step_split.py);
the same over 2 ranks is tests/distributed/test_step_split_ranks.py."""
import pytest
import torch

from step_split import CASES, COMPARED_METRICS, rollout, step_gradient


def assert_same_step(split, whole, case):
    (grad, record), (whole_grad, whole_record) = split, whole
    assert whole_grad.norm() > 0
    torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{case}: {m}")
    for name in COMPARED_METRICS:
        assert record[name] == pytest.approx(whole_record[name], rel=1e-5, abs=1e-7), f"{case}: {name}"


@pytest.mark.parametrize("case", CASES)
def test_micro_batches_give_the_gradient_and_metrics_of_the_whole_step(case):
    """Micro-batches of 1, 2 and 4 samples against one call over the 6: the normalizers are the step's (response
    tokens, samples), each Query-KL term counts once per sample whatever micro-batch holds it, and an
    entropy_agg="token-mean" bonus is the step's token mean (it was each micro-batch's mean, summed: k times too
    strong over k micro-batches)."""
    whole = step_gradient(CASES[case], 6, rollout())
    for micro in (1, 2, 4):
        assert_same_step(step_gradient(CASES[case], micro, rollout()), whole, f"{case} micro={micro}")


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_step_whose_responses_are_all_masked_trains_the_query_kl(loss_agg):
    """algorithm.mask_truncated with every response of the step truncated: no response token is scored anywhere
    (num_items 0, which the loss refuses), the policy term is 0 and the Query-KL still trains, split or not (TRL
    clamps its token count to 1 the same way). It stopped the run with 'num_items must be ... > 0, got 0'."""
    overrides = ["algorithm.mask_truncated=true", f"algorithm.loss_agg={loss_agg}"]
    every_truncated = rollout(truncated=(True,) * 6)
    whole = step_gradient(overrides, 6, every_truncated)
    assert whole[1]["response_tokens"] == 0 and whole[1]["pg_loss"] == 0.0
    assert whole[1]["loss"] == pytest.approx(0.01 * whole[1]["qkl"]) and whole[1]["qkl"] > 0.1
    assert_same_step(step_gradient(overrides, 2, every_truncated), whole, loss_agg)
