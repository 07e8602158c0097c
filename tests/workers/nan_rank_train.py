"""`erpo train` whose rank 1 gets a NaN loss on its first micro-batch (used by tests/distributed/test_multirank.py)."""
import os

import erpo.train.update_step as update_step
from erpo.cli import run  # as the console script: a rank ends without the interpreter's teardown (erpo.cli.run)

real_loss = update_step.fused_linear_erpo_loss
calls = {"n": 0}


def nan_once_on_rank_1(*args, **kwargs):
    out = real_loss(*args, **kwargs)
    calls["n"] += 1
    if os.environ.get("RANK") == "1" and calls["n"] == 1:
        out.loss = out.loss * float("nan")
    return out


update_step.fused_linear_erpo_loss = nan_once_on_rank_1
run()
