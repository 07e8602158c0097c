"""erpo.train.advantages: GRPO (with / without std), RLOO, REINFORCE baseline, DAPO equal-reward groups."""
import pytest
import torch

from erpo.train.advantages import EPS, compute_advantages, equal_reward_groups, nanstd, reward_std

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])  # two groups of 4


def test_grpo_group_normalized():
    adv = compute_advantages(REWARDS, 4)
    g = REWARDS.view(2, 4)
    expected = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + EPS)).reshape(-1)
    torch.testing.assert_close(adv, expected)
    assert abs(float(adv[:4].sum())) < 1e-5


def test_grpo_without_std_and_batch_scaling():
    adv = compute_advantages(REWARDS, 4, scale_rewards="none")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75]))
    batch = compute_advantages(REWARDS, 4, scale_rewards="batch")
    torch.testing.assert_close(batch, adv / (REWARDS.std() + EPS))


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


NAN = float("nan")
# two groups of 4 with unscored samples (NaN: every reward function returned None), a group of equal rewards, a
# group with one scored sample and one with none
UNSCORED = torch.tensor([1.0, NAN, 0.0, 0.5, 2.0, 2.0, NAN, 2.0, NAN, 3.0, NAN, NAN, NAN, NAN, NAN, NAN])


@pytest.mark.parametrize("values,dim", [(UNSCORED.view(4, 4), 1), (UNSCORED, None), (REWARDS.view(2, 4), 1),
                                        (torch.tensor([[NAN, 1.0]]), None)])
def test_nanstd_is_trl_s(values, dim):
    from trl.trainer.utils import nanstd as trl_nanstd
    torch.testing.assert_close(nanstd(values, dim).reshape(-1), trl_nanstd(values, dim=dim).reshape(-1),
                               equal_nan=True)


def trl_advantages(rewards, n, scale_rewards, eps):
    """TRL 1.16 GRPOTrainer's advantages (`_generate_and_score_completions`, multi_objective_aggregation
    "sum_then_normalize", one reward function), its statements on `rewards` [G * n] with NaN for the unscorable,
    its std zero test beside them; `eps` stands for its 1e-4."""
    from trl.trainer.utils import nanstd as trl_nanstd
    mean = torch.nanmean(rewards.view(-1, n), dim=1).repeat_interleave(n, dim=0)
    if scale_rewards in ("group", "none"):
        std = trl_nanstd(rewards.view(-1, n), dim=1).repeat_interleave(n, dim=0)
    else:
        std = trl_nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + eps)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("rewards", [UNSCORED, REWARDS], ids=["unscored", "scored"])
def test_a_rollout_step_computes_its_reward_std_once(monkeypatch, rewards, scale_rewards):
    """The rollout stage's advantages and zero-std flags (frac_reward_zero_std) are TRL's, from one reward_std."""
    from types import SimpleNamespace

    from erpo.train import advantages, rollout_stage
    calls = []

    def counted(*args):
        calls.append(args)
        return reward_std(*args)
    monkeypatch.setattr(advantages, "reward_std", counted)
    monkeypatch.setattr(rollout_stage, "reward_std", counted)
    cfg = SimpleNamespace(algorithm=SimpleNamespace(advantage="grpo", scale_rewards=scale_rewards),
                          rollout=SimpleNamespace(n=4))
    got, got_zero = rollout_stage.rollout_advantages(cfg, rewards)
    expected, std_zero = trl_advantages(rewards, 4, scale_rewards, EPS)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got_zero, std_zero) and len(calls) == 1


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("rewards", [UNSCORED, REWARDS], ids=["unscored", "scored"])
def test_grpo_advantages_are_trl_s_with_verl_s_epsilon(rewards, scale_rewards):
    """Unscored samples are left out of their group's mean and std and get advantage 0, Bessel-corrected stds, TRL's
    zero-std test: TRL's formula on the same batch, with erpo's epsilon (1e-6, EPS) for TRL's 1e-4."""
    expected, std_zero = trl_advantages(rewards, 4, scale_rewards, EPS)
    torch.testing.assert_close(compute_advantages(rewards, 4, scale_rewards=scale_rewards), expected)
    std = reward_std(rewards, 4, scale_rewards)
    assert torch.equal(torch.isclose(std, torch.zeros_like(std)), std_zero)
    if rewards is UNSCORED and scale_rewards == "group":
        assert std_zero.tolist() == [False] * 4 + [True] * 4 + [False] * 8


def test_the_epsilon_is_verl_s_not_trl_s():
    """erpo's 1e-6 against TRL's 1e-4, on a group whose std is small but not 0: a 1% apart at std 0.01."""
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.02])
    std = rewards.std()
    torch.testing.assert_close(compute_advantages(rewards, 4), (rewards - rewards.mean()) / (std + 1e-6))
    trl, _ = trl_advantages(rewards, 4, "group", 1e-4)
    ratio = compute_advantages(rewards, 4)[3] / trl[3]
    assert ratio == pytest.approx((std + 1e-4) / (std + 1e-6)) and 1.009 < ratio < 1.01


def test_rloo_and_reinforce_leave_unscored_samples_out():
    rewards = torch.tensor([1.0, NAN, 0.0, 4.0, NAN, 2.0, NAN, NAN])   # groups of 4: 3 scored, 1 scored
    rloo = compute_advantages(rewards, 4, estimator="rloo")
    # the others' mean among the scored: 1 - (0 + 4) / 2, 0 - 5 / 2, 4 - 1 / 2; alone in its group: 0
    torch.testing.assert_close(rloo, torch.tensor([-1.0, 0.0, -2.5, 3.5, 0.0, 0.0, 0.0, 0.0]))
    reinforce = compute_advantages(rewards, 4, estimator="reinforce", scale_rewards="none")
    torch.testing.assert_close(reinforce, torch.tensor([-0.75, 0.0, -1.75, 2.25, 0.0, 0.25, 0.0, 0.0]))
    batch = compute_advantages(rewards, 4, estimator="reinforce", scale_rewards="batch")
    torch.testing.assert_close(batch, reinforce / (torch.tensor([1.0, 0.0, 4.0, 2.0]).std() + EPS))


def test_equal_reward_groups_compare_the_scored_samples():
    assert equal_reward_groups(UNSCORED, 4).tolist() == [False, True, True, True]
