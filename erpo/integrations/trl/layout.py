"""TRL's micro-batch (left-padded prompts, right-padded completions) as erpo_kernels' packed rows, and back."""
from __future__ import annotations

from dataclasses import dataclass

from erpo.sequences import PackedBatch
from erpo_kernels import ScoredRows, completion_layout


@dataclass
class CompletionRows:
    """TRL's batch as the model's input and the loss's rows (`batch`: the scored rows alone, as both scorers take
    them), and the map between its completion-aligned [B, C] tensors and those rows (`scored.scatter`,
    `scored.gather`; `scored.layout.response_mask`)."""

    batch: PackedBatch
    scored: ScoredRows


def completion_rows(inputs: dict) -> CompletionRows:
    """Packed rows of one TRL micro-batch: query rows on the prompt, response rows on completion_mask x tool_mask,
    nothing on tool outputs or on completions that TRL masks (mask_truncated_completions)."""
    layout = completion_layout(prompt_ids=inputs["prompt_ids"], prompt_mask=inputs["prompt_mask"],
                               completion_ids=inputs["completion_ids"], completion_mask=inputs["completion_mask"],
                               tool_mask=inputs.get("tool_mask"))
    scored = layout.scored()
    batch = PackedBatch(layout.input_ids, layout.attention_mask, layout.rows, scored.targets, scored.token_kind,
                        scored.sample_index)
    return CompletionRows(batch, scored)
