"""The fused linear -> ERPO loss: per-token log-probs and entropies straight from hidden states and the lm_head
weight, never materializing the [N, V] logits (forward or backward).

    z_t   = (hidden_t @ weight.T + bias) / temperature           (never stored whole)
    logp_t = z_t[target_t] - logsumexp(z_t),   H_t = entropy of softmax(z_t)

One autograd function serves both backends; the backend supplies a forward (logp, entropy, lse) and a backward
(d hidden, d weight, d bias) that recomputes the logits block by block. The backward uses
    dz_j = g_logp (1[j == t] - p_j) - g_H p_j (log p_j + H),   dlogits = dz / temperature,
with the target entry formed in fp32 as g_logp (1 - p_t).

The torch backend here works on [block_rows, block_vocab] blocks of at most TORCH_BLOCK_ELEMENTS logits in fp32:
forward walks the vocabulary blocks of each row block and merges their (max, sum exp, shifted sum, target logit)
partials exactly as the Triton forward merges its vocabulary splits; backward walks vocabulary blocks outer and
row blocks inner so d weight of a block is finished before the next block starts. Extra memory: one block, an
fp32 [N, D] accumulator for d hidden (when hidden is not fp32) and O(N) vectors.
"""
from __future__ import annotations

import torch

from .api import loss_on_token_rows, use_triton
from .objective import LossOutput
from .reference import index_slices, rows_receiving_gradient
from .validation import FLOAT_DTYPES, IGNORE_INDEX, check_tensor, check_token_inputs

TORCH_BLOCK_ELEMENTS = 1 << 22  # fp32 logits per torch block (16 MiB)
TORCH_VOCAB_BLOCK_MAX = 8192
_MAX_FLOOR = -3.0e38  # running-max floor: keeps (m_old - m_new) * s finite when a block is all -inf


def block_shape(num_rows: int, vocab_size: int, max_elements: int, max_vocab: int) -> tuple[int, int]:
    """(rows, vocabulary ids) of one logits block of at most `max_elements` entries."""
    block_vocab = max(1, min(vocab_size, max_vocab, max_elements))
    block_rows = max(1, min(num_rows, max_elements // block_vocab))
    return block_rows, block_vocab


def merge_partials(maxes, sums, shifted_sums, target_logits, targets):
    """Merge per-vocabulary-part online-softmax partials, all [P, n] fp32 (max m, s = sum exp(z - m),
    u = sum exp(z - m)(z - m), target logit or 0), in a fixed order into (logp, entropy, lse), each [n] fp32.

    logp is clamped to <= 0 (it is z_t - lse with z_t one of the terms of lse) and is 0 where targets == -100.
    """
    row_max = maxes.amax(0)
    offset = maxes - row_max
    scale = torch.exp(offset)
    sum_exp = (scale * sums).sum(0)
    shifted = (scale * (shifted_sums + offset * sums)).sum(0)
    log_sum_exp = torch.log(sum_exp)
    lse = row_max + log_sum_exp
    entropy = log_sum_exp - shifted / sum_exp
    logp = torch.where(targets != IGNORE_INDEX, (target_logits.sum(0) - lse).clamp(max=0.0), 0.0)
    return logp, entropy, lse


def _logits_block(hidden_rows, weight, bias, cols: slice, temperature: float):
    """fp32 z = (hidden_rows @ weight[cols].T + bias[cols]) / temperature; hidden_rows is already fp32."""
    logits = hidden_rows @ weight[cols].float().t()
    if bias is not None:
        logits = logits + bias[cols].float()
    return logits / temperature


def _target_columns(targets, cols: slice):
    """(clamped column index [n, 1] inside the block, mask [n, 1] of rows whose target lies in the block)."""
    inside = (targets >= cols.start) & (targets < cols.stop)
    index = (targets - cols.start).clamp(0, cols.stop - cols.start - 1)
    return index.unsqueeze(1), inside.unsqueeze(1)


def torch_fused_linear_forward(hidden, weight, bias, targets, temperature: float):
    """hidden [N, D], weight [V, D], bias [V] or None, targets [N] int64 (-100 = ignored) ->
    (logp [N] fp32, entropy [N] fp32, lse [N] fp32), computed in fp32 block by block."""
    num_rows = hidden.shape[0]
    vocab_size = weight.shape[0]
    block_rows, block_vocab = block_shape(num_rows, vocab_size, TORCH_BLOCK_ELEMENTS, TORCH_VOCAB_BLOCK_MAX)
    logp, entropy, lse = (torch.empty(num_rows, dtype=torch.float32, device=hidden.device) for _ in range(3))
    for rows in index_slices(num_rows, block_rows):
        hidden_rows = hidden[rows].float()
        row_targets = targets[rows]
        partials = []
        for cols in index_slices(vocab_size, block_vocab):
            z = _logits_block(hidden_rows, weight, bias, cols, temperature)
            block_max = z.amax(1).clamp(min=_MAX_FLOOR)
            shifted = z - block_max.unsqueeze(1)
            e = shifted.exp()
            index, inside = _target_columns(row_targets, cols)
            target_logit = torch.where(inside, z.gather(1, index), 0.0).squeeze(1)
            partials.append((block_max, e.sum(1), torch.where(e > 0, e * shifted, 0.0).sum(1), target_logit))
        maxes, sums, shifted_sums, target_logits = (torch.stack(part) for part in zip(*partials))
        logp[rows], entropy[rows], lse[rows] = merge_partials(maxes, sums, shifted_sums, target_logits, row_targets)
    return logp, entropy, lse


def torch_fused_linear_backward(hidden, weight, bias, targets, temperature: float, lse, entropy,
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
            log_p = _logits_block(hidden_rows, weight, bias, cols, temperature) - lse[rows].unsqueeze(1)
            p = log_p.exp()
            g_logp, g_entropy = grad_logp[rows].unsqueeze(1), grad_entropy[rows].unsqueeze(1)
            entropy_part = torch.where(p > 0, g_entropy * p * (log_p + entropy[rows].unsqueeze(1)), 0.0)
            dz = -g_logp * p - entropy_part
            index, inside = _target_columns(targets[rows], cols)
            target_dz = g_logp * (1.0 - p.gather(1, index)) - entropy_part.gather(1, index)
            dz.scatter_(1, index, torch.where(inside, target_dz, dz.gather(1, index)))
            dlogits = torch.where(receives_gradient[rows].unsqueeze(1), dz, 0.0) / temperature
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


class _FusedLinearLogprobs(torch.autograd.Function):
    """(hidden, weight, bias, targets, temperature, (forward_fn, backward_fn)) -> (logp [N] fp32, entropy [N] fp32)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, engine):
        logp, entropy, lse = engine[0](hidden, weight, bias, targets, temperature)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.engine = engine
        ctx.weight_shape = weight.shape
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        if weight.shape != ctx.weight_shape:
            raise RuntimeError(f"the weight changed shape between forward {tuple(ctx.weight_shape)} and backward "
                               f"{tuple(weight.shape)}: under DeepSpeed ZeRO-3 run the backward inside "
                               f"erpo_kernels.zero3.gathered_lm_head(...) so the lm_head stays gathered")
        grad_hidden, grad_weight, grad_bias = ctx.engine[1](
            hidden, weight, bias, targets, ctx.temperature, lse, entropy,
            grad_logp.float().contiguous(), grad_entropy.float().contiguous(),
            ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _engine(triton: bool):
    if triton:
        from .triton_fused_linear import triton_fused_linear_backward, triton_fused_linear_forward
        return triton_fused_linear_forward, triton_fused_linear_backward
    return torch_fused_linear_forward, torch_fused_linear_backward


def check_linear_inputs(hidden, weight, bias) -> None:
    """hidden [N, D], weight [V, D] and bias [V] or None: same float dtype (fp32/bf16/fp16), same device."""
    check_tensor("hidden", hidden, ndim=2, floating=True)
    if hasattr(weight, "ds_id") and weight.numel() == 0:
        raise ValueError("weight is a DeepSpeed ZeRO-3 partitioned parameter (an empty shard outside its module's "
                         "forward); pass the lm_head through erpo_kernels.zero3.gathered_lm_head(model) and run the "
                         "backward inside that block")
    check_tensor("weight", weight, ndim=2, floating=True)
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} does not match hidden dtype {hidden.dtype}; cast one of them")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must have shape [V, D] with D = hidden.shape[1] = {hidden.shape[1]}, "
                         f"got {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have a non-empty vocabulary dimension (shape [V, D] with V > 0)")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, length=weight.shape[0], floating=True,
                     length_name=" (V, the rows of weight)")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} does not match hidden dtype {hidden.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but hidden is on {hidden.device}")


def fused_linear_logp_entropy(hidden, weight, bias, scored_targets, temperature: float, triton: bool):
    """(logp [N] fp32, entropy [N] fp32) of (hidden @ weight.T + bias) / temperature on validated inputs;
    scored_targets [N] int64 with -100 on ignored rows. Saves nothing for backward when no gradient is needed."""
    engine = _engine(triton)
    targets = scored_targets.long().contiguous()
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                              or (bias is not None and bias.requires_grad))
    if not wants_grad:
        logp, entropy, _ = engine[0](hidden, weight, bias, targets, float(temperature))
        return logp, entropy
    return _FusedLinearLogprobs.apply(hidden, weight, bias, targets, float(temperature), engine)


def fused_linear_token_logprobs(hidden, weight, targets, *, bias=None, temperature: float = 1.0,
                                return_entropy: bool = False, backend: str = "auto"):
    """Per-token log-probabilities of the targets under logits = hidden @ weight.T + bias, never materialized.

    hidden [N, D], weight [V, D] (the lm_head, may be tied), bias [V] or None, all fp32/bf16/fp16 of one dtype;
    targets [N] int (in [0, V), or -100 for ignored rows). Returns logp [N] fp32 (nats, 0 where target == -100)
    and, when return_entropy, entropy [N] fp32 (nats). Differentiable in hidden, weight and bias.
    """
    check_linear_inputs(hidden, weight, bias)
    scored_targets = check_token_inputs(targets, num_rows=hidden.shape[0], vocab_size=weight.shape[0],
                                        device=hidden.device, temperature=temperature, rows_name="hidden")
    logp, entropy = fused_linear_logp_entropy(hidden, weight, bias, scored_targets, temperature,
                                              use_triton(backend, hidden.device))
    return (logp, entropy) if return_entropy else logp


def fused_linear_erpo_loss(hidden, weight, targets, token_kind, sample_index, *, bias=None, advantages,
                           ref_query_logp=None, query_weight=None, old_logp=None, ref_logp=None,
                           token_weight=None, rollout_logp=None, backend: str = "auto", **options) -> LossOutput:
    """The ERPO loss (API.md) from hidden [N, D] and the lm_head weight [V, D] (+ bias [V]) without the [N, V]
    logits: targets, token_kind, sample_index [N]; advantages, ref_query_logp, query_weight [S]; old_logp,
    ref_logp, token_weight, rollout_logp [N]; options as API.md's table (and docs/API.md's additions). Returns a
    LossOutput whose `loss` is differentiable with respect to hidden, weight and bias.
    """
    check_linear_inputs(hidden, weight, bias)

    def token_pass(scored_targets, temperature, triton):
        return fused_linear_logp_entropy(hidden, weight, bias, scored_targets, temperature, triton)

    return loss_on_token_rows(
        token_pass, num_rows=hidden.shape[0], vocab_size=weight.shape[0], device=hidden.device, backend=backend,
        targets=targets, token_kind=token_kind, sample_index=sample_index, options=options,
        tensors=dict(advantages=advantages, ref_query_logp=ref_query_logp, query_weight=query_weight,
                     old_logp=old_logp, ref_logp=ref_logp, token_weight=token_weight,
                     rollout_logp=rollout_logp))
