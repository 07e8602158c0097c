"""What `erpo train` passes reward functions as `trainer_state`, TRL's keyword: the attributes of transformers'
`TrainerState` that erpo fills truthfully, under their names and meanings, so that a curriculum written for TRL's
GRPOTrainer (`trainer_state.global_step / trainer_state.max_steps`) runs unchanged. Any other attribute is an
AttributeError that lists these."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TrainerProgress:
    """Where the run is when a rollout step's samples are rewarded."""
    global_step: int              # optimizer steps done so far (TRL's count when it generates a batch)
    max_steps: int                # optimizer steps the run plans: trainer.max_steps (rollout steps) x optimizer steps
                                  # per rollout step (rollout_batch_size / update_batch_size): the LR schedule's length
    epoch: float                  # passes over the training prompts done where this rollout step's prompts begin
                                  # (1.25: a quarter into the second pass), fractional as TRL's
    is_world_process_zero: bool   # this process is rank 0 of the run
    is_local_process_zero: bool   # this process is rank 0 of its node

    def __getattr__(self, name: str):
        # called only for a name the dataclass does not hold: a TrainerState attribute erpo cannot fill
        filled = ", ".join(f.name for f in fields(self))
        raise AttributeError(f"trainer_state.{name}: erpo train fills only {filled} of TRL's trainer_state "
                             "(docs/training.md, Rewards)")
