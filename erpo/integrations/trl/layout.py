"""TRL's micro-batch (left-padded prompts, right-padded completions) as erpo_kernels' packed rows, and back."""
from __future__ import annotations

from dataclasses import dataclass

from erpo.sequences import PackedBatch
from erpo_kernels import CompletionLayout, ScoredRows, completion_layout


@dataclass
class CompletionRows:
    """TRL's batch as the model's input and the loss's rows, in the form one scorer takes them.

    layout: every position of the batch as a row (`erpo_kernels.CompletionLayout`; `layout.response_mask` [B, C]).
    batch: the model's input (input_ids, attention_mask [B, T]) and the loss's rows (targets, token_kind,
    sample_index), as `erpo.sequences.per_sample_sum` reads them. loss_rows: the map between completion-aligned
    [B, C] tensors and those rows (`scatter`, `gather`).
    With `every_position` (the logits path) batch and loss_rows are the layout itself, kind 0 where nothing is
    scored: the logits [B * T, V] are the rows as the model returns them (no selection, no host read, no copy).
    Otherwise (the fused-linear path) the scored rows alone (`layout.scored()`, one host read), which spares the
    GEMMs the padding: a PackedBatch whose `rows` select them from the hidden states, and whose `host_layout`, that
    read's, the loss's chunk plan takes instead of reading the rows again."""

    layout: CompletionLayout
    batch: CompletionLayout | PackedBatch
    loss_rows: CompletionLayout | ScoredRows


def completion_rows(inputs: dict, *, every_position: bool) -> CompletionRows:
    """Packed rows of one TRL micro-batch: query rows on the prompt, response rows on completion_mask x tool_mask,
    nothing on tool outputs or on completions that TRL masks (mask_truncated_completions)."""
    layout = completion_layout(prompt_ids=inputs["prompt_ids"], prompt_mask=inputs["prompt_mask"],
                               completion_ids=inputs["completion_ids"], completion_mask=inputs["completion_mask"],
                               tool_mask=inputs.get("tool_mask"))
    if every_position:
        return CompletionRows(layout, layout, layout)
    scored = layout.scored()
    batch = PackedBatch(layout.input_ids, layout.attention_mask, layout.rows, scored.targets, scored.token_kind,
                        scored.sample_index, row_index=scored.index, host_layout=scored.host_layout)
    return CompletionRows(layout, batch, scored)
