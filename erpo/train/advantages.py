"""Advantages from per-sample rewards of prompt groups: GRPO, RLOO, REINFORCE with a baseline; DAPO group filter.

Samples are laid out group by group: `rewards` [G * n] holds the n responses of prompt 0, then prompt 1, ...
A NaN reward is a sample that no reward function scored (every one returned None): as TRL 1.16's GRPOTrainer, it
is left out of every mean and std and its advantage is 0.
"""
from __future__ import annotations

import torch

# Added to the std an advantage is divided by: verl's and EasyR1's 1e-6 (the paper's recipe ran on EasyR1), not
# TRL's 1e-4. They differ only where a std is nonzero and tiny: by a factor (std + 1e-6) / (std + 1e-4), under 1%
# for a std above 0.01 (a group of 8 with one 0.1 format reward has 0.035); a group of equal rewards gets 0 either way.
EPS = 1e-6


def _grouped(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """`rewards` [G * n] as fp32 [G, n]; ValueError unless it is 1-D with a length divisible by n >= 1."""
    if rewards.dim() != 1 or n <= 0 or rewards.numel() % n:
        raise ValueError(f"rewards must be 1-D with a length divisible by n={n}, got shape {tuple(rewards.shape)}")
    return rewards.float().view(-1, n)


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected std of `values` over `dim` (all of it when None; kept as a size-1 dim), NaNs left out;
    NaN where fewer than two values are not NaN. TRL's `trl.trainer.utils.nanstd`, the std of its advantages and
    reward metrics."""
    dims = tuple(range(values.dim())) if dim is None else dim
    mean = values.nanmean(dim=dims, keepdim=True)
    count = (~values.isnan()).sum(dim=dims, keepdim=True)
    squares = (values - mean).square().nansum(dim=dims, keepdim=True)
    return (squares / (count - 1).clamp(min=1)).sqrt().where(count > 1, torch.nan)


def reward_std(rewards: torch.Tensor, n: int, scale_rewards: str) -> torch.Tensor:
    """[G * n]: the std each sample's advantage is divided by, as TRL's GRPOTrainer computes it: `nanstd` over the
    sample's group (scale_rewards "group", and "none", where it only feeds `frac_reward_zero_std`) or over the
    whole batch ("batch"); 0 for a group (a batch) of one sample."""
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    groups = _grouped(rewards, n)
    if scale_rewards == "batch":
        return nanstd(groups).expand_as(groups).reshape(-1) if groups.numel() > 1 else torch.zeros(groups.numel())
    return (nanstd(groups, dim=1) if n > 1 else torch.zeros_like(groups[:, :1])).expand_as(groups).reshape(-1)


def compute_advantages(rewards: torch.Tensor, n: int, *, estimator: str = "grpo", scale_rewards: str = "group",
                       std: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages [G * n] fp32 for `rewards` [G * n] (NaN: unscored, advantage 0; means and stds leave it out).
    `std`: `reward_std(rewards, n, scale_rewards)` where the caller has computed it already (the rollout stage,
    which also logs whether it is 0); computed here when None.

    grpo: r - mean(group), divided by std(group) + 1e-6 when scale_rewards="group", by the batch std when "batch",
          not divided when "none" (Dr. GRPO);
    rloo: r - mean of the other responses of the group;
    reinforce: r - mean over the whole batch (one global baseline), scaled like grpo when scale_rewards="batch".
    Stds are Bessel-corrected (`reward_std`).
    """
    groups = _grouped(rewards, n)
    std = (reward_std(rewards, n, scale_rewards) if std is None else std).view_as(groups)
    if estimator == "grpo":
        adv = groups - groups.nanmean(dim=1, keepdim=True)
    elif estimator == "rloo":
        if n < 2:
            raise ValueError("rloo needs n >= 2 responses per prompt")
        scored = (~groups.isnan()).sum(dim=1, keepdim=True)
        # a group's only scored response has no other to compare with: 0 / 0, an advantage of 0 below
        others = (groups.nansum(dim=1, keepdim=True) - groups) / (scored - 1)
        adv = groups - others
    elif estimator == "reinforce":
        adv = groups - groups.nanmean()
    else:
        raise ValueError(f"estimator must be grpo, rloo or reinforce, got {estimator!r}")
    if scale_rewards == "batch" or (scale_rewards == "group" and estimator == "grpo"):
        adv = adv / (std + EPS)
    return adv.reshape(-1).nan_to_num(nan=0.0)


def equal_reward_groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """Bool [G]: groups whose scored rewards are all equal, or none is scored (no learning signal; DAPO dynamic
    sampling drops them)."""
    groups = _grouped(rewards, n)
    low = groups.nan_to_num(nan=torch.inf).amin(dim=1)
    high = groups.nan_to_num(nan=-torch.inf).amax(dim=1)
    return low >= high
