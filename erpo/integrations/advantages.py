"""One advantage per sample from a trainer's token-level advantages [B, R]: verl and OpenRLHF both broadcast an
outcome estimator's value (GRPO, RLOO, ...) along each response, and ERPO's loss takes that value once per sample."""
from __future__ import annotations

import torch


def sample_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level advantages [B, R] with response_mask [B, R] -> (one per sample [B] fp32, its value on the first
    response token, 0 for a sample without one; whether any varies along its response: a 0-dim bool on the device,
    no read, which the caller refuses in its own words, as a per-token advantage such as GAE's is not ERPO's)."""
    mask = response_mask.bool()
    first = torch.where(mask.any(1), mask.float().argmax(1), 0)
    per_sample = torch.where(mask.any(1), advantages.float().gather(1, first[:, None]).squeeze(1), 0.0)
    return per_sample, (mask & (advantages.float() != per_sample[:, None])).any()
