"""The torch reference: per-token log-probabilities and entropies, written as the equations read.

    z_t    = softcap(logits_t * logit_scale) / temperature    (`LogitTransform`; softcap(x) = c tanh(x / c))
    logp_t = log_softmax(z_t)[targets_t]         (0 where targets_t == -100)
    H_t    = -sum_j p_tj * log p_tj,  p_t = softmax(z_t)

A row that receives no gradient (d loss / d logp_t = d loss / d H_t = 0: padding, a zero advantage, a clipped
ratio) gets an exactly zero gradient row, whatever its logits: a non-finite padding row must not turn the
update into NaN through 0 * NaN.

All math is in fp32. Rows are processed in chunks so that no fp32 copy of the whole [N, V] logits exists at
once; the backward recomputes each chunk and lets autograd differentiate the same equations, so this module is
an independent oracle for the hand-derived gradients of the Triton kernels.
"""
from __future__ import annotations

import torch

from .common import index_slices, rows_receiving_gradient, transform_logits
from .validation import IGNORE_INDEX, NO_TRANSFORM, LogitTransform

CHUNK_ELEMENTS = 1 << 24  # fp32 elements per chunk (64 MiB)


def logp_and_entropy(logits: torch.Tensor, targets: torch.Tensor, transform: LogitTransform):
    """Per-row target log-prob and entropy of one chunk: logits [n, V] -> ([n] fp32, [n] fp32)."""
    log_probs = torch.log_softmax(transform_logits(logits.float(), transform), dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs.masked_fill(probs == 0, 0.0)).sum(-1)
    scored = targets != IGNORE_INDEX
    target_logp = log_probs.gather(-1, torch.where(scored, targets, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(scored, target_logp, 0.0), entropy


def row_chunks(num_rows: int, row_width: int):
    """Row slices of at most CHUNK_ELEMENTS elements each."""
    return index_slices(num_rows, max(1, CHUNK_ELEMENTS // max(1, row_width)))


class _ChunkedLogpEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, transform):
        logp = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logp)
        for rows in row_chunks(logits.shape[0], logits.shape[1]):
            logp[rows], entropy[rows] = logp_and_entropy(logits[rows], targets[rows], transform)
        ctx.save_for_backward(logits, targets)
        ctx.transform = transform
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets = ctx.saved_tensors
        receives_gradient = rows_receiving_gradient(targets, grad_logp, grad_entropy)
        grad_logits = torch.empty_like(logits)
        for rows in row_chunks(logits.shape[0], logits.shape[1]):
            with torch.enable_grad():
                chunk = logits[rows].detach().requires_grad_(True)
                logp, entropy = logp_and_entropy(chunk, targets[rows], ctx.transform)
                (grad_chunk,) = torch.autograd.grad((logp, entropy), chunk, (grad_logp[rows], grad_entropy[rows]))
            grad_logits[rows] = torch.where(receives_gradient[rows, None], grad_chunk, 0.0)
        return grad_logits, None, None


def reference_token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                             transform: LogitTransform = NO_TRANSFORM):
    """logits [N, V] (any float dtype), targets [N] int64 (-100 = ignored) -> (logp [N] fp32, entropy [N] fp32)
    of the transformed logits (`LogitTransform`: scale, soft-cap, temperature; the identity by default).

    Differentiable with respect to `logits`; the gradient has the dtype of `logits`. Under torch.compile the
    equations are taken whole (the compiler's autograd differentiates them; it cannot trace the chunked backward's
    autograd.grad), a row holding a non-finite logit then passing no gradient at all.
    """
    if torch.compiler.is_compiling():
        finite_rows = torch.isfinite(logits).all(-1, keepdim=True)
        return logp_and_entropy(torch.where(finite_rows, logits, logits.detach()), targets, transform)
    return _ChunkedLogpEntropy.apply(logits, targets, transform)
