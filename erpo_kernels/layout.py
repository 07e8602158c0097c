"""From the padded [B, L] batches of HF-style trainers to the packed token rows of the loss.

Row i of the loss is position t of a sequence and predicts input_ids[t + 1]. A row is a query row when
token t + 1 is a query (prompt) token, a response row when token t + 1 is a response token, and not scored
otherwise (padding, the first token of each sequence, which nothing predicts, and every token after the first
response token that is not itself a response token: tool outputs and observations of a multi-turn sample belong
neither to the query q nor to what the policy generated).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .validation import IGNORE_INDEX, check_tensor

QUERY, RESPONSE = 1, 2


@dataclass
class PackedRows:
    """Packed rows of a padded batch: each [B * L] (row b * L + t is position t of sequence b)."""

    targets: torch.Tensor       # int64, next token id, -100 on rows of kind 0
    token_kind: torch.Tensor    # int64, 0 / 1 (query) / 2 (response)
    sample_index: torch.Tensor  # int64, b


def from_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                query_mask: torch.Tensor | None = None) -> PackedRows:
    """Packed rows for a left- or right-padded batch.

    input_ids, attention_mask, response_mask: [B, L]. attention_mask is 1 on real tokens (prompt, response and
    anything else), response_mask is 1 on the tokens the policy generated. The query tokens are the real tokens
    before the first response token of each sequence; a multi-turn sample's later non-response tokens (tool
    outputs, observations) are not scored. query_mask [B, L], optional, marks the query tokens instead, for
    callers who decide themselves; it must lie inside attention_mask and not overlap response_mask.
    Use the result with logits reshaped to [B * L, V] (and hidden states to [B * L, D]); the sample of row
    b * L + t is b.
    """
    masks = (("input_ids", input_ids), ("attention_mask", attention_mask), ("response_mask", response_mask))
    if query_mask is not None:
        masks += (("query_mask", query_mask),)
    for name, tensor in masks:
        check_tensor(name, tensor, ndim=2)
        if tensor.shape != input_ids.shape:
            raise ValueError(f"{name} must have input_ids' [B, L] shape {tuple(input_ids.shape)}, got "
                             f"{tuple(tensor.shape)} (all masks and input_ids must have the same shape)")
    real = attention_mask.bool()
    response = response_mask.bool()
    if bool((response & ~real).any()):
        raise ValueError("response_mask marks a token that attention_mask marks as padding")
    if query_mask is None:
        # Everything real before the first response token: the cumulative count is 0 there.
        query = real & (response.long().cumsum(dim=1) == 0)
    else:
        query = query_mask.bool()
        if bool((query & ~real).any()):
            raise ValueError("query_mask marks a token that attention_mask marks as padding")
        if bool((query & response).any()):
            raise ValueError("query_mask and response_mask both mark the same token; a token is one or the other")
    batch, length = input_ids.shape
    # Row t scores token t + 1; the last position of each sequence scores nothing, and neither does a padding
    # position (so the first real token of each sequence, predicted by padding or by nothing, is never scored).
    next_query = torch.zeros_like(query)
    next_query[:, :-1] = query[:, 1:]
    next_response = torch.zeros_like(response)
    next_response[:, :-1] = response[:, 1:]
    kind = torch.zeros((batch, length), dtype=torch.long, device=input_ids.device)
    kind[real & next_query] = QUERY
    kind[real & next_response] = RESPONSE
    targets = torch.full_like(input_ids, IGNORE_INDEX, dtype=torch.long)
    targets[:, :-1] = torch.where(kind[:, :-1] != 0, input_ids[:, 1:].long(), IGNORE_INDEX)
    sample_index = torch.arange(batch, device=input_ids.device).unsqueeze(1).expand(batch, length)
    return PackedRows(targets=targets.reshape(-1), token_kind=kind.reshape(-1),
                      sample_index=sample_index.reshape(-1).clone())
