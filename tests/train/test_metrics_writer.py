"""erpo.train.metrics.MetricsWriter on a resume: the steps after the checkpoint, logged again, are held once in
metrics.jsonl and shown once by TensorBoard."""
import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from erpo.cli.args import config_from_args
from erpo.cli.commands import build_parser
from erpo.train.metrics import MetricsWriter


def write_steps(out, steps, *, resume: bool, done_steps: int, reward: float) -> None:
    cfg = config_from_args(build_parser().parse_args(
        ["train", "--set", "logging.tensorboard=true", "logging.progress_bar=false"]))
    writer = MetricsWriter(cfg, out, resume=resume, total_steps=5, done_steps=done_steps)
    for step in steps:
        writer.write({"step": step, "reward": reward + step, "qkl": 0.0})
    writer.close()


def test_a_resume_shows_each_step_once_with_the_resumed_run_s_value(tmp_path):
    # the first run logged steps 1-5 and was killed; its newest checkpoint is step 3, so the resume logs 4 and 5 again
    write_steps(tmp_path, range(1, 6), resume=False, done_steps=0, reward=0.0)
    write_steps(tmp_path, range(4, 6), resume=True, done_steps=3, reward=100.0)
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward"]) for r in jsonl] == [(1, 1), (2, 2), (3, 3), (4, 104), (5, 105)]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("train/reward")]
    assert shown == [(1, 1), (2, 2), (3, 3), (4, 104), (5, 105)]
