"""The rollout engine interface: what the trainer and `erpo eval` ask of an engine that samples n responses per
prompt (`RolloutEngine`), and what it returns (`RolloutBatch`)."""
from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass
class RolloutBatch:
    prompt_index: list[int]            # which input prompt each sample came from (len B*n), grouped by prompt
    prompt_ids: list[list[int]]        # token ids of the prompt, as fed to the model
    response_ids: list[list[int]]      # generated token ids (no padding; EOS included if produced)
    response_logp: list[list[float]] | None   # sampling log-probs per response token, if the backend gives them
    truncated: list[bool]              # hit max_new_tokens without EOS


class RolloutEngine(abc.ABC):
    """Generates responses with the current policy weights."""

    # What a seed draws with this engine, recorded by `erpo eval`'s sample cache (erpo.eval.sample_cache): an engine
    # whose seed -> samples mapping changes gets a new value, so a cache filled before is refused, not served.
    seeding: str

    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float = 1.0,
                 max_new_tokens: int, seed: int | None = None) -> RolloutBatch:
        """n samples per prompt, grouped: samples [i*n, (i+1)*n) belong to prompt i."""

    @abc.abstractmethod
    def sync_weights(self, model) -> None:
        """Load the trainer's current weights; called after each optimizer step."""

    def sleep(self) -> None:
        """Release generation memory while the trainer updates (optional)."""

    def wake_up(self) -> None:
        """Undo `sleep` before the next generate (optional)."""
