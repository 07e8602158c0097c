"""erpo.train.advantages: GRPO (with / without std), RLOO, REINFORCE baseline, DAPO equal-reward groups."""
import pytest
import torch

from erpo.train.advantages import compute_advantages, equal_reward_groups

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])  # two groups of 4


def test_grpo_group_normalized():
    adv = compute_advantages(REWARDS, 4)
    g = REWARDS.view(2, 4)
    expected = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).reshape(-1)
    torch.testing.assert_close(adv, expected)
    assert abs(float(adv[:4].sum())) < 1e-5


def test_grpo_without_std_and_batch_scaling():
    adv = compute_advantages(REWARDS, 4, scale_rewards="none")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75]))
    batch = compute_advantages(REWARDS, 4, scale_rewards="batch")
    torch.testing.assert_close(batch, adv / (REWARDS.std() + 1e-6))


def test_rloo_leave_one_out():
    adv = compute_advantages(torch.tensor([1.0, 0.0, 2.0]), 3, estimator="rloo")
    torch.testing.assert_close(adv, torch.tensor([1.0 - 1.0, 0.0 - 1.5, 2.0 - 0.5]))


def test_reinforce_global_baseline():
    adv = compute_advantages(REWARDS, 4, estimator="reinforce", scale_rewards="none")
    torch.testing.assert_close(adv, REWARDS - REWARDS.mean())


def test_equal_groups_get_zero_advantage_and_are_flagged():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    assert compute_advantages(rewards, 3)[:3].abs().max() == 0
    assert equal_reward_groups(rewards, 3).tolist() == [True, False]


@pytest.mark.parametrize("kwargs,match", [({"n": 3}, "divisible"), ({"n": 4, "estimator": "ppo"}, "estimator"),
                                          ({"n": 4, "scale_rewards": "row"}, "scale_rewards"),
                                          ({"n": 1, "estimator": "rloo"}, "n >= 2")])
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(REWARDS, **kwargs)


def test_equal_reward_groups_rejects_a_bad_group_size():
    with pytest.raises(ValueError, match="divisible by n=3"):
        equal_reward_groups(REWARDS, 3)
