"""A run's metrics.jsonl as the resume tests compare it (train and distributed tiers): the last record logged for
each optimizer step without its wall-clock fields, and two runs' records compared key by key."""
import json
from pathlib import Path

import pytest

HELD_REWARD_METRICS = "rewards/hold/"   # held_reward.py's `hold`: null mean and std (it rewards nothing)


def metrics_by_step(out: Path) -> dict[int, dict]:
    """{optimizer step: the last record logged for it} from `out`/metrics.jsonl (a resumed run logs the steps after
    its checkpoint again), without the wall-clock fields (`*_seconds`), which differ between any two runs, and without
    the null `rewards/hold/*` of tests/workers/held_reward.py, which a held run adds to the same metrics."""
    records = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = {k: v for k, v in record.items()
                                   if not k.endswith("_seconds") and not k.startswith(HELD_REWARD_METRICS)}
    return records


def assert_same_metrics(actual: dict, expected: dict, abs_tol: float = 1e-6) -> None:
    """`actual` and `expected` (`metrics_by_step`'s) log the same steps with the same keys and values: floats within
    a relative 1e-5 and an absolute `abs_tol`, anything else equal."""
    assert sorted(actual) == sorted(expected)
    for step, record in expected.items():
        assert sorted(actual[step]) == sorted(record), step
        for key, value in record.items():
            if isinstance(value, float):
                assert actual[step][key] == pytest.approx(value, rel=1e-5, abs=abs_tol), (step, key)
            else:
                assert actual[step][key] == value, (step, key)
