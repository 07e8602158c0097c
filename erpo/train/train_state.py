"""The counters of a training run between steps (`TrainState`), and the record a checkpoint keeps of them with the
prompt sampler's position (meta.json's "state": the same keys as before this type existed, and "training_set" since
it is recorded)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TrainState:
    """Where a run is: rollout and optimizer steps done, optimizer steps skipped for a non-finite loss or gradient,
    the reference cache it trains against (its `cache_id`), the LR schedule's length in optimizer steps and the
    training prompts the sampler's position refers to (`erpo.tasks.data.prompt_set_identity`)."""
    reference_cache_id: str
    lr_schedule_steps: int
    training_set: dict
    rollout_step: int = 0
    opt_step: int = 0
    nonfinite_skipped: int = 0

    def checkpoint_record(self, sampler_position: dict) -> dict:
        """What a checkpoint saves: these fields and the sampler's position {"epoch", "cursor"}."""
        return {"rollout_step": self.rollout_step, "opt_step": self.opt_step, **sampler_position,
                "nonfinite_skipped": self.nonfinite_skipped, "reference_cache_id": self.reference_cache_id,
                "lr_schedule_steps": self.lr_schedule_steps, "training_set": self.training_set}

    @classmethod
    def from_checkpoint_record(cls, record: dict, lr_schedule_steps: int, training_set: dict) -> TrainState:
        """The counters of a checkpoint's record, with this run's schedule length (a constant LR may change it) and
        training set (the same as the record's, checked by `erpo.train.run_dir.check_resumed_training_set`, or one a
        checkpoint of an older erpo did not record)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"lr_schedule_steps", "training_set"}
        return cls(lr_schedule_steps=lr_schedule_steps, training_set=training_set,
                   **{name: record[name] for name in names})
