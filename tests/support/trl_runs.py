"""What the ERPOTrainer tests share (tests/integrations/test_trl_integration.py, the ZeRO-3 worker
tests/workers/trl_zero3_worker.py): the prompts, a reward the tiny model moves quickly, and the trainer's settings."""

PROMPTS = ["1+1=", "22+3=", "7*8=", "10-4=", "9+9=", "3*33="]

# ERPOConfig's settings besides output_dir: 4 samples of 2 generations, 6 tokens each, fp32 (TRL computes its head
# in the autocast dtype), no reporting, no checkpoints, seeded
TRAINER_SETTINGS = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=6, report_to=[],
                        use_cpu=True, logging_steps=1, save_strategy="no", seed=0, disable_dropout=True, bf16=False)


def reward_length(completions, **kwargs):
    """A reward the tiny model can move quickly: longer completions score higher."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]
