"""TRL's micro-batch (left-padded prompts, right-padded completions) as erpo_kernels' packed rows, and back."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from erpo.sequences import PackedBatch
from erpo_kernels import from_padded


@dataclass
class CompletionRows:
    """TRL's batch (left-padded prompts [B, P], right-padded completions [B, T]) as erpo_kernels' packed rows.

    Completion token j of sample b is predicted at position P + j - 1, so TRL's completion-aligned [B, T]
    tensors (old / reference log-probs, importance-sampling ratios) land on rows through `scatter`.
    """

    batch: PackedBatch
    prompt_width: int
    response_mask: torch.Tensor  # [B, T] float: completion_mask x tool_mask, the tokens TRL's loss scores

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[B, T] or [B, 1] completion-aligned values -> [R] values on the scored rows (0 on query rows)."""
        num, width = self.batch.input_ids.shape
        full = torch.zeros((num, width), dtype=torch.float32, device=values.device)
        full[:, self.prompt_width - 1:width - 1] = values.float().expand_as(self.response_mask)
        return full.reshape(-1)[self.batch.rows]

    def gather(self, row_values: torch.Tensor) -> torch.Tensor:
        """[R] values on the scored rows -> [B, T] completion-aligned values."""
        num, width = self.batch.input_ids.shape
        full = torch.zeros(num * width, dtype=row_values.dtype, device=row_values.device)
        full[self.batch.rows] = row_values
        return full.reshape(num, width)[:, self.prompt_width - 1:width - 1]


def completion_rows(inputs: dict) -> CompletionRows:
    """Packed rows of one TRL micro-batch: query rows on the prompt, response rows on completion_mask x tool_mask,
    nothing on tool outputs or on completions that TRL masks (mask_truncated_completions)."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    response = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    packed = from_padded(input_ids, attention_mask, torch.cat([torch.zeros_like(prompt_mask), response], dim=1),
                         query_mask=torch.cat([prompt_mask, torch.zeros_like(completion_mask)], dim=1))
    rows = packed.token_kind != 0
    batch = PackedBatch(input_ids, attention_mask, rows, packed.targets[rows], packed.token_kind[rows],
                        packed.sample_index[rows])
    return CompletionRows(batch, prompt_ids.shape[1], response.float())
