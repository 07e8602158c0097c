"""The torch per-row kernels of the fused-linear chunks (fused_linear_loss.py), the twins of the logits path's
Triton kernels: log-prob, entropy and log-sum-exp of whole rows of fp32 logits (the online-softmax partials of
`common`, merged as one part), and the gradient of the logits given d loss / d logp and d loss / d entropy (the
derivation in fused_linear.py's docstring). All in fp32; a row that receives no gradient gets exact zeros.
"""
from __future__ import annotations

import torch

from .common import merge_partials, rows_receiving_gradient, softmax_partials, transform_logits, transform_slope
from .validation import IGNORE_INDEX


def _target_columns(targets, cols: slice):
    """(clamped column index [n, 1] inside the block, mask [n, 1] of rows whose target lies in the block)."""
    inside = (targets >= cols.start) & (targets < cols.stop)
    index = (targets - cols.start).clamp(0, cols.stop - cols.start - 1)
    return index.unsqueeze(1), inside.unsqueeze(1)


def grad_of_logits_block(logits, cols: slice, targets, transform, lse, entropy, grad_logp, grad_entropy,
                         receives_gradient):
    """d logits [n, v] fp32 of sum(grad_logp * logp + grad_entropy * entropy) on the block `cols` of fp32 logits
    [n, v] (before the transform) of n rows: targets, lse, entropy, grad_logp, grad_entropy, receives_gradient [n]
    (module docstring of fused_linear.py: dz_j = g_logp (1[j == t] - p_j) - g_H p_j (log p_j + H), the target
    entry formed as g_logp (1 - p_t)); rows that receive no gradient get exact zeros."""
    log_p = transform_logits(logits, transform) - lse.unsqueeze(1)
    p = log_p.exp()
    g_logp, g_entropy = grad_logp.unsqueeze(1), grad_entropy.unsqueeze(1)
    entropy_part = torch.where(p > 0, g_entropy * p * (log_p + entropy.unsqueeze(1)), 0.0)
    dz = -g_logp * p - entropy_part
    index, inside = _target_columns(targets, cols)
    target_dz = g_logp * (1.0 - p.gather(1, index)) - entropy_part.gather(1, index)
    dz.scatter_(1, index, torch.where(inside, target_dz, dz.gather(1, index)))
    return torch.where(receives_gradient.unsqueeze(1), dz * transform_slope(logits, transform), 0.0)


def torch_rows_forward(logits, targets, transform):
    """(logp, entropy, lse) [n] fp32 of the transformed logits [n, V] (any float dtype) of n whole rows; targets [n]
    int64, -100 = ignored: the torch twin of the Triton op erpo::triton_logp_entropy."""
    z = transform_logits(logits.float(), transform)
    index, inside = _target_columns(targets, slice(0, logits.shape[1]))
    target_logit = torch.where(inside, z.gather(1, index), 0.0).squeeze(1)
    return merge_partials(*(part.unsqueeze(0) for part in (*softmax_partials(z), target_logit)), targets)


def torch_rows_gradient(logits, targets, lse, entropy, grad_logp, grad_entropy, transform):
    """d logits [n, V] fp32 of sum(grad_logp * logp + grad_entropy * entropy) (all [n] fp32) on the logits [n, V]
    of n whole rows: the torch twin of erpo::triton_logp_entropy_backward."""
    grad_logp = torch.where(targets != IGNORE_INDEX, grad_logp, 0.0)
    receives_gradient = rows_receiving_gradient(targets, grad_logp, grad_entropy)
    return grad_of_logits_block(logits.float(), slice(0, logits.shape[1]), targets, transform, lse, entropy,
                                grad_logp, grad_entropy, receives_gradient)
