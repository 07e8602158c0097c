"""From the padded [B, L] batches of HF-style trainers to the packed token rows of the loss: `from_padded` (any
padding), and `completion_layout` for TRL's prompt [B, P] + completion [B, C] columns with completion-aligned tensors.

Row i of the loss is position t of a sequence and predicts input_ids[t + 1]. A row is a query row when
token t + 1 is a query (prompt) token, a response row when token t + 1 is a response token, and not scored
otherwise (padding, the first token of each sequence, which nothing predicts, and every token after the first
response token that is not itself a response token: tool outputs and observations of a multi-turn sample belong
neither to the query q nor to what the policy generated).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .common import host_to_device
from .validation import IGNORE_INDEX, check_rows, check_tensor, check_validate, read_later

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
    b * L + t is b. The mask checks cost one host read.
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
    if query_mask is None:
        # Everything real before the first response token: the cumulative count is 0 there.
        query = real & (response.long().cumsum(dim=1) == 0)
        checks = []
    else:
        query = query_mask.bool()
        checks = [(query & ~real, "query_mask marks a token that attention_mask marks as padding"),
                  (query & response, "query_mask and response_mask both mark the same token; a token is one or "
                                     "the other")]
    check_rows([(bad.reshape(-1), lambda row, message=message: message) for bad, message in
                [(response & ~real, "response_mask marks a token that attention_mask marks as padding"), *checks]])
    return packed_rows(input_ids, real, query, response)


def packed_rows(input_ids: torch.Tensor, real: torch.Tensor, query: torch.Tensor,
                response: torch.Tensor) -> PackedRows:
    """`from_padded`'s rows from masks it has checked (or that hold by construction): input_ids [B, L], real,
    query, response [B, L] bool (query and response inside real, apart). No host read."""
    # Row t scores token t + 1; the last position of each sequence scores nothing, and neither does a padding
    # position (so the first real token of each sequence, predicted by padding or by nothing, is never scored).
    next_query = torch.zeros_like(query)
    next_query[:, :-1] = query[:, 1:]
    next_response = torch.zeros_like(response)
    next_response[:, :-1] = response[:, 1:]
    # torch.where, not a boolean-mask assignment (an index_put_ that may read the mask on the host)
    kind = torch.where(real & next_response, RESPONSE, torch.where(real & next_query, QUERY, 0))
    return rows_of_kind(input_ids, kind)


def rows_of_kind(input_ids: torch.Tensor, kind: torch.Tensor) -> PackedRows:
    """The packed rows of input_ids [B, L] whose positions have the kinds `kind` [B, L] int64 (0 on the last
    column): the target of row t is token t + 1 where its kind is not 0, else -100. No host read."""
    batch, length = input_ids.shape
    # the last column's kind is 0, so the token that roll brings round to it is never a target
    targets = input_ids.long().roll(-1, dims=1).masked_fill(kind == 0, IGNORE_INDEX)
    sample_index = torch.arange(batch, device=input_ids.device).unsqueeze(1).expand(batch, length)
    return PackedRows(targets=targets.reshape(-1), token_kind=kind.reshape(-1),
                      sample_index=sample_index.reshape(-1))


@dataclass
class CompletionLayout:
    """A batch in TRL's layout, P prompt columns then C completion columns ([B, T], T = P + C), as packed rows: one
    row per position, row b * T + t for position t of sequence b (kind 0 where nothing is scored), so logits
    [B, T, V] are the rows as `logits.reshape(B * T, V)`, with no selection (no host read, no copy).

    Completion token j of sample b is predicted at position P + j - 1, so completion-aligned [B, C] tensors (old /
    reference / rollout log-probs, per-token weights) land on the rows through `scatter`, and per-row results come
    back to [B, C] through `gather`. The sample of every row of sequence b is b. `scored()` selects the scored rows
    alone (the fused-linear path, whose GEMMs would otherwise run on the padding).
    """

    input_ids: torch.Tensor       # [B, T] prompt then completion
    attention_mask: torch.Tensor  # [B, T]
    targets: torch.Tensor         # [B * T] int64, -100 on rows of kind 0
    token_kind: torch.Tensor      # [B * T] 0 (not scored) / 1 (query) / 2 (response)
    sample_index: torch.Tensor    # [B * T] in [0, B)
    prompt_width: int             # P
    response_mask: torch.Tensor   # [B, C] float: completion_mask x tool_mask, the completion tokens that are scored

    @property
    def rows(self) -> torch.Tensor:
        """[B * T] bool: the scored rows (query or response)."""
        return self.token_kind != 0

    def completion_rows(self, row_values: torch.Tensor) -> torch.Tensor:
        """[B * T] values -> [B, C]: entry j of sequence b is row b * T + P + j - 1, the row that scores completion
        token j."""
        batch, width = self.input_ids.shape
        return row_values.reshape(batch, width)[:, self.prompt_width - 1:width - 1]

    def __post_init__(self):
        # [B, C] bool: the completion tokens that no response row scores (scatter and gather zero them), formed once
        self._unscored = self.completion_rows(self.token_kind) != RESPONSE

    def scatter(self, values: torch.Tensor, name: str = "values") -> torch.Tensor:
        """[B, C] or [B, 1] completion-aligned values -> [B * T] fp32 values on the response rows (0 elsewhere)."""
        batch, width = self.input_ids.shape
        check_tensor(name, values, ndim=2)
        if values.shape[0] != batch or values.shape[1] not in (1, self.response_mask.shape[1]):
            raise ValueError(f"{name} must be completion-aligned, shape [B, C] = {tuple(self.response_mask.shape)} "
                             f"(or [B, 1]), got {tuple(values.shape)}")
        # completion token j onto column P + j - 1, the row that scores it; the other columns 0
        on_completion = values.float().masked_fill(self._unscored, 0.0)
        return torch.nn.functional.pad(on_completion, (self.prompt_width - 1, 1)).reshape(-1)

    def gather(self, row_values: torch.Tensor) -> torch.Tensor:
        """[B * T] values on the rows -> [B, C] completion-aligned values (0 where nothing is scored)."""
        return self.completion_rows(row_values).masked_fill(self._unscored, 0)

    def scored(self) -> ScoredRows:
        """The scored rows alone (`ScoredRows`): one host read, of token_kind; the rows are found on the host and
        their positions uploaded without a wait, and the selection's layout stays on the host for the chunk plan of
        `fused_linear_erpo_loss` (`ScoredRows.host_layout`), which then reads nothing."""
        host_kind = read_later(self.token_kind)().cpu().numpy()
        host_index = np.nonzero(host_kind)[0]
        index = host_to_device(host_index, self.token_kind.device)
        host_layout = torch.from_numpy(np.stack((host_kind[host_index], host_index // self.input_ids.shape[1])))
        return ScoredRows(self, index, *(rows.index_select(0, index) for rows in (self.targets, self.token_kind,
                                                                            self.sample_index)), host_layout)


@dataclass
class ScoredRows:
    """The R scored rows of a `CompletionLayout`, in position order: row r is the layout's row index[r]."""

    layout: CompletionLayout
    index: torch.Tensor         # [R] int64: positions b * T + t of the scored rows, ascending
    targets: torch.Tensor       # [R] int64
    token_kind: torch.Tensor    # [R] 1 (query) / 2 (response)
    sample_index: torch.Tensor  # [R] in [0, B)
    host_layout: torch.Tensor   # [2, R] int64 host memory: token_kind and sample_index of these rows

    def select(self, row_values: torch.Tensor) -> torch.Tensor:
        """[B * T, *] values on the layout's rows (hidden states [B * T, D]) -> [R, *] on the scored rows."""
        return row_values.index_select(0, self.index)

    def scatter(self, values: torch.Tensor, name: str = "values") -> torch.Tensor:
        """[B, C] or [B, 1] completion-aligned values -> [R] fp32 values on the scored rows (0 on query rows)."""
        return self.select(self.layout.scatter(values, name))

    def gather(self, row_values: torch.Tensor) -> torch.Tensor:
        """[R] values on the scored rows -> [B, C] completion-aligned values (0 where nothing is scored)."""
        full = row_values.new_zeros(self.layout.token_kind.shape[0]).index_copy(0, self.index, row_values)
        return self.layout.gather(full)


def completion_layout(*, completion_mask: torch.Tensor, prompt_ids: torch.Tensor | None = None,
                      prompt_mask: torch.Tensor | None = None, completion_ids: torch.Tensor | None = None,
                      input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                      tool_mask: torch.Tensor | None = None, validate: bool = True) -> CompletionLayout:
    """The packed rows of a batch in TRL's layout, given either as prompt_ids / prompt_mask [B, P] (left-padded)
    and completion_ids [B, C] (right-padded), or as full sequences input_ids / attention_mask [B, T] whose last C
    columns are the completion; completion_mask [B, C] either way (1 on the completion's real tokens).

    Query rows predict the prompt's real tokens; response rows predict the completion tokens where completion_mask
    x tool_mask is 1 (tool_mask [B, C], optional: 0 on tool outputs inside a multi-turn completion, which are
    then not scored, as `from_padded`'s multi-turn samples). With prompt/completion ids, the attention mask is
    prompt_mask then completion_mask (as TRL's forward); with full sequences it is attention_mask.
    validate: with full sequences, check that completion_mask x tool_mask lies inside attention_mask (one host read;
    the prompt/completion form holds it by construction and reads nothing); False skips it (no host read).
    """
    check_validate(validate)
    split, full = (prompt_ids, prompt_mask, completion_ids), (input_ids, attention_mask)
    full_sequences = all(t is None for t in split) and all(t is not None for t in full)
    if all(t is None for t in full) and all(t is not None for t in split):
        check_tensor("prompt_ids", prompt_ids, ndim=2)
        check_tensor("completion_ids", completion_ids, ndim=2)
        check_tensor("completion_mask", completion_mask, ndim=2)
        if completion_mask.shape != completion_ids.shape:
            raise ValueError(f"completion_mask must have completion_ids' shape {tuple(completion_ids.shape)}, got "
                             f"{tuple(completion_mask.shape)}")
        check_tensor("prompt_mask", prompt_mask, ndim=2)
        if prompt_mask.shape != prompt_ids.shape:
            raise ValueError(f"prompt_mask must have prompt_ids' shape {tuple(prompt_ids.shape)}, got "
                             f"{tuple(prompt_mask.shape)}")
        if prompt_ids.shape[0] != completion_ids.shape[0]:
            raise ValueError(f"prompt_ids and completion_ids must hold the same B sequences, got shapes "
                             f"{tuple(prompt_ids.shape)} and {tuple(completion_ids.shape)}")
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    elif full_sequences:
        check_tensor("input_ids", input_ids, ndim=2)
        check_tensor("completion_mask", completion_mask, ndim=2)
        if completion_mask.shape[0] != input_ids.shape[0] or not 0 < completion_mask.shape[1] < input_ids.shape[1]:
            raise ValueError(f"completion_mask must have shape [B, C] with C < T for input_ids [B, T] = "
                             f"{tuple(input_ids.shape)} (the last C columns are the completion), got "
                             f"{tuple(completion_mask.shape)}")
    else:
        raise ValueError("pass either prompt_ids, prompt_mask and completion_ids, or input_ids and attention_mask "
                         "(full sequences whose last C columns are the completion), not a mix")
    response_mask = completion_mask
    if tool_mask is not None:
        check_tensor("tool_mask", tool_mask, ndim=2)
        if tool_mask.shape != completion_mask.shape:
            raise ValueError(f"tool_mask must have completion_mask's shape {tuple(completion_mask.shape)}, got "
                             f"{tuple(tool_mask.shape)}")
        response_mask = completion_mask * tool_mask
    prompt_width = input_ids.shape[1] - completion_mask.shape[1]
    real = attention_mask != 0
    response = response_mask != 0
    # The kind of the token each position predicts, by columns: positions 0 to P - 2 predict a prompt token (a
    # query token when real), P - 1 to T - 2 a completion token (a response token where response_mask holds),
    # T - 1 nothing; a position that is padding scores nothing. The query tokens are thus the prompt columns' real
    # tokens, inside real and apart from the response tokens by construction.
    next_kind = torch.cat((real[:, 1:prompt_width] * QUERY, response * RESPONSE, torch.zeros_like(real[:, :1])),
                          dim=1)
    packed = rows_of_kind(input_ids, next_kind * real)
    layout = CompletionLayout(input_ids, attention_mask, packed.targets, packed.token_kind, packed.sample_index,
                              prompt_width, response_mask.float())
    if validate and full_sequences:
        check_rows([mask_check(layout)])
    return layout


def mask_check(layout: CompletionLayout):
    """The `check_rows` pair of `completion_layout`'s full-sequence check: bad [B * C] where completion_mask x
    tool_mask marks a completion token that attention_mask marks as padding, and its message (no host read)."""
    width = layout.response_mask.shape[1]
    bad = (layout.response_mask != 0) & (layout.attention_mask[:, layout.prompt_width:] == 0)
    return bad.reshape(-1), lambda row: (f"completion_mask marks completion token {row % width} of sample "
                                         f"{row // width}, which attention_mask marks as padding; the masks must "
                                         f"agree on the last C columns")
