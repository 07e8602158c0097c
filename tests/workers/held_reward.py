"""A reward function (`reward.functions=[tests/workers/held_reward.py:hold]`) that lets a test stop `erpo train` in a
known rollout step without racing it (tests/train/test_resume.py's SIGTERM test, test_storage_faults.py's second
writer test).

It rewards nothing (None for every sample: the run's other reward functions decide, as with TRL's nansum), so a run with
it logs what the run without it does, but for its own null `rewards/hold/mean` and `/std`. Where the environment names a
folder in ERPO_TEST_HOLD_DIR (only the test sets it), its call in rollout step ERPO_TEST_HOLD_STEP (it is called once
per rollout step) creates `held` there and waits until the test creates `release`, meanwhile the run is inside that
step."""
import os
import time
from pathlib import Path

RELEASE_TIMEOUT_S = 600   # a run whose test has died ends with an error rather than waiting for ever
calls = 0                 # rollout steps scored so far in this process


def hold(prompts: list[str], completions: list[str], **columns) -> list[None]:
    """None for each of the completions; holds the run as the module docstring says."""
    global calls
    calls += 1
    folder = os.environ.get("ERPO_TEST_HOLD_DIR")
    if folder and calls == int(os.environ["ERPO_TEST_HOLD_STEP"]):
        (Path(folder) / "held").touch()
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        while not (Path(folder) / "release").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"held_reward: nothing created {folder}/release within {RELEASE_TIMEOUT_S} s")
            time.sleep(0.05)
    return [None] * len(completions)
