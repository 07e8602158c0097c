"""The torch backend of the fused linear pass (see fused_linear.py for the math): fp32 blocks of the logits.

It works on [block_rows, block_vocab] blocks of at most TORCH_BLOCK_ELEMENTS logits in fp32: forward walks the
vocabulary blocks of each row block and merges their online-softmax partials (`common.softmax_partials`, then
`common.merge_partials`, exactly as the Triton forward merges its vocabulary splits); backward walks vocabulary
blocks outer and row blocks inner so d weight of a block is finished before the next block starts. Extra memory:
one block, an fp32 [N, D] accumulator for d hidden (when hidden is not fp32) and O(N) vectors.
"""
from __future__ import annotations

import torch

from .common import (
    index_slices,
    merge_partials,
    rows_receiving_gradient,
    softmax_partials,
    transform_logits,
    transform_slope,
)
from .validation import IGNORE_INDEX

TORCH_BLOCK_ELEMENTS = 1 << 22  # fp32 logits per torch block (16 MiB)
TORCH_VOCAB_BLOCK_MAX = 8192


def block_shape(num_rows: int, vocab_size: int, max_elements: int, max_vocab: int) -> tuple[int, int]:
    """(rows, vocabulary ids) of one logits block of at most `max_elements` entries."""
    block_vocab = max(1, min(vocab_size, max_vocab, max_elements))
    block_rows = max(1, min(num_rows, max_elements // block_vocab))
    return block_rows, block_vocab


def _logits_block(hidden_rows, weight, bias, cols: slice):
    """fp32 logits = hidden_rows @ weight[cols].T + bias[cols] (before the transform); hidden_rows is already fp32."""
    logits = hidden_rows @ weight[cols].float().t()
    if bias is not None:
        logits = logits + bias[cols].float()
    return logits


def _target_columns(targets, cols: slice):
    """(clamped column index [n, 1] inside the block, mask [n, 1] of rows whose target lies in the block)."""
    inside = (targets >= cols.start) & (targets < cols.stop)
    index = (targets - cols.start).clamp(0, cols.stop - cols.start - 1)
    return index.unsqueeze(1), inside.unsqueeze(1)


def torch_fused_linear_forward(hidden, weight, bias, targets, transform):
    """hidden [N, D], weight [V, D], bias [V] or None, targets [N] int64 (-100 = ignored) ->
    (logp [N] fp32, entropy [N] fp32, lse [N] fp32) of the transformed logits (`LogitTransform`), computed in fp32
    block by block."""
    num_rows = hidden.shape[0]
    vocab_size = weight.shape[0]
    block_rows, block_vocab = block_shape(num_rows, vocab_size, TORCH_BLOCK_ELEMENTS, TORCH_VOCAB_BLOCK_MAX)
    logp, entropy, lse = (torch.empty(num_rows, dtype=torch.float32, device=hidden.device) for _ in range(3))
    for rows in index_slices(num_rows, block_rows):
        hidden_rows = hidden[rows].float()
        row_targets = targets[rows]
        partials = []
        for cols in index_slices(vocab_size, block_vocab):
            z = transform_logits(_logits_block(hidden_rows, weight, bias, cols), transform)
            index, inside = _target_columns(row_targets, cols)
            target_logit = torch.where(inside, z.gather(1, index), 0.0).squeeze(1)
            partials.append((*softmax_partials(z), target_logit))
        stacked = (torch.stack(part) for part in zip(*partials))  # running_max, sum_exp, sum_exp_shifted, target
        logp[rows], entropy[rows], lse[rows] = merge_partials(*stacked, row_targets)
    return logp, entropy, lse


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


def torch_fused_linear_backward(hidden, weight, bias, targets, transform, lse, entropy,
                                grad_logp, grad_entropy, needs_hidden: bool, needs_weight: bool, needs_bias: bool):
    """(d hidden [N, D], d weight [V, D], d bias [V]) of sum(grad_logp * logp + grad_entropy * entropy), each None
    when not needed; logits recomputed per block in fp32, gradients accumulated in fp32."""
    num_rows, hidden_dim = hidden.shape
    vocab_size = weight.shape[0]
    block_rows, block_vocab = block_shape(num_rows, vocab_size, TORCH_BLOCK_ELEMENTS, TORCH_VOCAB_BLOCK_MAX)
    grad_logp = torch.where(targets != IGNORE_INDEX, grad_logp, 0.0)
    receives_gradient = rows_receiving_gradient(targets, grad_logp, grad_entropy)
    grad_hidden = torch.zeros(num_rows, hidden_dim, dtype=torch.float32, device=hidden.device) if needs_hidden else None
    grad_weight = torch.empty_like(weight) if needs_weight else None
    grad_bias = torch.empty_like(bias) if needs_bias else None
    for cols in index_slices(vocab_size, block_vocab):
        weight_block = weight[cols].float()
        weight_block_grad = torch.zeros_like(weight_block) if needs_weight else None
        bias_block_grad = (torch.zeros(weight_block.shape[0], dtype=torch.float32, device=hidden.device)
                           if needs_bias else None)
        for rows in index_slices(num_rows, block_rows):
            # rows that receive no gradient: zero dlogits and zero hidden rows (no 0 * NaN in d weight)
            hidden_rows = torch.where(receives_gradient[rows].unsqueeze(1), hidden[rows].float(), 0.0)
            dlogits = grad_of_logits_block(_logits_block(hidden_rows, weight, bias, cols), cols, targets[rows],
                                           transform, lse[rows], entropy[rows], grad_logp[rows], grad_entropy[rows],
                                           receives_gradient[rows])
            if needs_hidden:
                grad_hidden[rows] += dlogits @ weight_block
            if needs_weight:
                weight_block_grad += dlogits.t() @ hidden_rows
            if needs_bias:
                bias_block_grad += dlogits.sum(0)
        if needs_weight:
            grad_weight[cols] = weight_block_grad
        if needs_bias:
            grad_bias[cols] = bias_block_grad
    if needs_hidden:
        grad_hidden = grad_hidden.to(hidden.dtype)
    return grad_hidden, grad_weight, grad_bias
