"""Advantages from per-sample rewards of prompt groups: GRPO, RLOO, REINFORCE with a baseline; DAPO group filter.

Samples are laid out group by group: `rewards` [G * n] holds the n responses of prompt 0, then prompt 1, ...
"""
from __future__ import annotations

import torch

EPS = 1e-6


def _grouped(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """`rewards` [G * n] as fp32 [G, n]; ValueError unless it is 1-D with a length divisible by n >= 1."""
    if rewards.dim() != 1 or n <= 0 or rewards.numel() % n:
        raise ValueError(f"rewards must be 1-D with a length divisible by n={n}, got shape {tuple(rewards.shape)}")
    return rewards.float().view(-1, n)


def compute_advantages(rewards: torch.Tensor, n: int, *, estimator: str = "grpo",
                       scale_rewards: str = "group") -> torch.Tensor:
    """Advantages [G * n] fp32 for `rewards` [G * n].

    grpo: r - mean(group), divided by std(group) + 1e-6 when scale_rewards="group", by the batch std when "batch",
          not divided when "none" (Dr. GRPO);
    rloo: r - mean of the other n - 1 responses of the group;
    reinforce: r - mean over the whole batch (one global baseline), scaled like grpo when scale_rewards="batch".
    """
    groups = _grouped(rewards, n)
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    r = groups.reshape(-1)
    if estimator == "grpo":
        adv = groups - groups.mean(dim=1, keepdim=True)
        if scale_rewards == "group":
            std = groups.std(dim=1, keepdim=True) if n > 1 else torch.zeros_like(groups[:, :1])
            adv = adv / (std + EPS)
        adv = adv.reshape(-1)
    elif estimator == "rloo":
        if n < 2:
            raise ValueError("rloo needs n >= 2 responses per prompt")
        others = (groups.sum(dim=1, keepdim=True) - groups) / (n - 1)
        adv = (groups - others).reshape(-1)
    elif estimator == "reinforce":
        adv = r - r.mean()
    else:
        raise ValueError(f"estimator must be grpo, rloo or reinforce, got {estimator!r}")
    if scale_rewards == "batch" and r.numel() > 1:
        adv = adv / (r.std() + EPS)
    return adv


def equal_reward_groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """Bool [G]: groups whose n rewards are all equal (no learning signal; DAPO dynamic sampling drops them)."""
    groups = _grouped(rewards, n)
    return (groups == groups[:, :1]).all(dim=1)
