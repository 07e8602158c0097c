"""erpo.train.checkpoint: atomic saves, retention, exact restore (weights, optimizer, scheduler, RNG), crash
safety under SIGKILL, graceful SIGTERM, and the Hugging Face export."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from erpo.models.export import export_hf, publish_hf
from erpo.models.tiny import build_model, build_tokenizer
from erpo.models.weights import link_or_copy
from erpo.train.checkpoint import CheckpointManager, TorchBundle
from erpo.train.stop import GracefulStop

REPO = Path(__file__).resolve().parents[2]


def tiny_bundle(seed=0):
    model = build_model(build_tokenizer(), seed=seed, hidden_size=16, intermediate_size=32, num_layers=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return TorchBundle(model, optimizer, scheduler)


def train_step(bundle, seed):
    ids = torch.randint(3, 60, (2, 6), generator=torch.Generator().manual_seed(seed))
    loss = bundle.model(input_ids=ids, labels=ids).loss
    loss.backward()
    bundle.optimizer.step()
    bundle.optimizer.zero_grad()
    bundle.scheduler.step()
    return loss.item()


def rng_draws():
    return random.random(), float(np.random.rand()), torch.rand(2)


def test_save_load_restores_training_exactly(tmp_path):
    bundle = tiny_bundle()
    train_step(bundle, 0)
    manager = CheckpointManager(tmp_path)
    path = manager.save(1, bundle, {"prompts_consumed": 64, "reference_cache_id": "abc"})
    assert Path(path) == tmp_path / "checkpoints" / "step-1"
    draws_after_save = rng_draws()
    expected = [train_step(bundle, s) for s in (1, 2)]
    expected_params = {k: v.clone() for k, v in bundle.model.state_dict().items()}

    fresh = tiny_bundle(seed=1)  # different weights; the checkpoint must overwrite everything
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    state = manager.load(fresh)
    assert state == {"prompts_consumed": 64, "reference_cache_id": "abc", "step": 1}
    draws_after_load = rng_draws()
    assert draws_after_load[:2] == draws_after_save[:2]
    assert torch.equal(draws_after_load[2], draws_after_save[2])
    assert [train_step(fresh, s) for s in (1, 2)] == expected      # optimizer moments + LR schedule restored
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, expected_params[name]), name


def test_keep_last_and_latest_ignore_incomplete(tmp_path):
    bundle = TorchBundle(torch.nn.Linear(2, 2))
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.latest() is None
    for step in (3, 7, 10):
        manager.save(step, bundle, {})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-10", "step-7"]
    with pytest.raises(ValueError, match="step 10 from another run"):
        manager.save(8, bundle, {})
    (root / ".tmp-step-20").mkdir()                  # interrupted save
    (root / "step-11").mkdir()                       # no meta.json: not complete
    (root / ".trash-step-1").mkdir()                 # interrupted deletion
    assert manager.latest() == str(root / "step-10")
    manager.save(11, bundle, {})
    names = sorted(p.name for p in root.iterdir())
    assert ".tmp-step-20" not in names and ".trash-step-1" not in names and "step-11" in names
    assert manager.save(11, bundle, {"ignored": True}) == str(root / "step-11")  # already complete
    assert json.loads((root / "step-11" / "meta.json").read_text())["state"] == {}


def test_keep_every_keeps_the_history_and_resume_picks_the_last(tmp_path):
    """keep_every=4 with keep_last=2: after saves at steps 1..10, steps 4 and 8 stay besides the newest two, and a
    resume loads the newest (step 10), not a kept older one."""
    bundle = TorchBundle(torch.nn.Linear(2, 2))
    manager = CheckpointManager(tmp_path, keep_last=2, keep_every=4)
    for step in range(1, 11):
        with torch.no_grad():
            bundle.model.weight.fill_(step)
        manager.save(step, bundle, {"step_weight": step})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-10", "step-4", "step-8", "step-9"]
    assert [s for s, _ in manager.complete_checkpoints()] == [4, 8, 9, 10]
    assert manager.latest() == str(root / "step-10")
    fresh = TorchBundle(torch.nn.Linear(2, 2))
    assert manager.load(fresh)["step"] == 10
    assert torch.equal(fresh.model.weight, torch.full((2, 2), 10.0))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="keep_every must be an int >= 0"):
            CheckpointManager(tmp_path, keep_every=bad)


def test_checkpoints_dir_is_used_as_is(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=None)
    manager.save(1, TorchBundle(torch.nn.Linear(1, 1)), {})
    assert (tmp_path / "checkpoints" / "step-1" / "meta.json").is_file()


def test_bad_arguments(tmp_path):
    bundle = TorchBundle(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="step"):
        manager.save(-1, bundle, {})
    with pytest.raises(TypeError, match="JSON"):
        manager.save(1, bundle, {"tensor": torch.ones(1)})
    with pytest.raises(TypeError, match="engine"):
        manager.save(1, torch.nn.Linear(1, 1), {})
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        manager.load(bundle)
    manager.save(1, bundle, {})
    with pytest.raises(FileNotFoundError, match="optimizer"):
        manager.load(TorchBundle(bundle.model, torch.optim.SGD(bundle.model.parameters(), lr=1.0)))


def wait_for_path(proc: subprocess.Popen, path: Path, what: str, timeout: float = 120) -> None:
    """Wait until `path` exists, made by the process `proc` when it reaches `what`; fail naming `what` if the
    process ends first (with the end of its stderr when piped, as bytes or text) or after `timeout` s. The one
    file-wait loop of the train tier (test_resume.start_held_run's wait for a run held in a known step, which
    test_storage_faults' runs use too)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            stderr = proc.stderr.read() if proc.stderr else ""
            stderr = (stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr)[-4000:]
            raise AssertionError(f"the process ended (status {proc.returncode}) before {what}\n{stderr}")
        assert time.monotonic() < deadline, f"the process never reached {what} within {timeout} s"
        time.sleep(0.1)


KILL_SCRIPT = r"""
import sys, time, torch
from pathlib import Path
from erpo.train.checkpoint import CheckpointManager, TorchBundle
out = Path(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
manager = CheckpointManager(out, keep_last=1)
def step():
    model(torch.randn(4, 64)).square().sum().backward(); optimizer.step(); optimizer.zero_grad()
step()
manager.save(1, TorchBundle(model, optimizer), {"step_done": 1})
torch.save(model.state_dict(), out / "expected_step1.pt")
step()
def hang():
    (out / "inside_save").touch()
    time.sleep(600)
manager.before_commit = hang
manager.save(2, TorchBundle(model, optimizer), {"step_done": 2})
"""


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    script = tmp_path / "kill_me.py"
    script.write_text(KILL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stderr=subprocess.PIPE)
    try:
        wait_for_path(proc, tmp_path / "inside_save", "the save")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.stderr.close()
    root = tmp_path / "checkpoints"
    assert (root / ".tmp-step-2" / "meta.json").is_file()   # step 2 was fully written but never committed
    manager = CheckpointManager(tmp_path, keep_last=1)
    assert manager.latest() == str(root / "step-1")
    model = torch.nn.Linear(64, 64)
    bundle = TorchBundle(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    assert manager.load(bundle) == {"step_done": 1, "step": 1}
    expected = torch.load(tmp_path / "expected_step1.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    manager.save(2, bundle, {"step_done": 2})                # the run goes on and cleans up
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]


def test_graceful_stop_sets_flag_and_restores_handler():
    previous = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stop:
        assert not stop.requested and not stop.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs between bytecodes of the main thread
            if stop.requested:
                break
            time.sleep(0.01)
        assert stop.requested and stop.received == signal.SIGTERM and stop.should_stop()
        assert signal.getsignal(signal.SIGTERM) == previous   # a second SIGTERM is not swallowed
    assert signal.getsignal(signal.SIGTERM) == previous
    with pytest.raises(ValueError, match="signals"):
        GracefulStop(signals=())


def test_graceful_stop_puts_the_second_signal_s_handler_in_place_before_its_line(monkeypatch):
    # the line says a second signal stops at once: one sent as soon as the line is read must find that handler (the
    # handler was put back after the line, so a second Ctrl-C answering it at once could be taken as a first again)
    from erpo.train import stop as stop_module
    handler_at_the_line = []
    monkeypatch.setattr(stop_module.logger, "warning",
                        lambda *args: handler_at_the_line.append(signal.getsignal(signal.SIGINT)))
    previous = signal.getsignal(signal.SIGINT)
    with GracefulStop() as stop:
        stop.handle(signal.SIGINT, None)
    assert handler_at_the_line == [previous]


SIGTERM_SCRIPT = r"""
import sys, time, torch
from pathlib import Path
from erpo.train.checkpoint import CheckpointManager, TorchBundle
from erpo.train.stop import GracefulStop
out = Path(sys.argv[1])
model = torch.nn.Linear(2, 2)
manager = CheckpointManager(out)
with GracefulStop() as stop:
    for step in range(1, 10**6):
        (out / "running").touch()
        time.sleep(0.05)                      # the "training step"
        if stop.should_stop():
            manager.save(step, TorchBundle(model), {"stopped_at": step})
            sys.exit(0)
"""


def test_sigterm_finishes_step_and_saves(tmp_path):
    script = tmp_path / "term_me.py"
    script.write_text(SIGTERM_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    try:
        wait_for_path(proc, tmp_path / "running", "its first step")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    latest = CheckpointManager(tmp_path).latest()
    assert latest is not None
    meta = json.loads((Path(latest) / "meta.json").read_text())
    assert meta["state"]["stopped_at"] == meta["step"] >= 1


def test_checkpoints_hold_a_loadable_hf_export(tmp_path):
    """`export=True` puts a `from_pretrained`-loadable model + tokenizer in `step-N/hf/`, written inside the
    temporary directory before the commit rename; retention still keeps the newest `keep_last`."""
    tokenizer = build_tokenizer()
    bundle = tiny_bundle()
    manager = CheckpointManager(tmp_path, keep_last=2)
    root = tmp_path / "checkpoints"
    before_rename = []
    manager.before_commit = lambda: before_rename.append(
        ((root / ".tmp-step-1" / "hf" / "model.safetensors").is_file(), (root / "step-1").exists()))
    path = Path(manager.save(1, bundle, {}, export=True, tokenizer=tokenizer))
    assert before_rename == [(True, False)]
    manager.before_commit = None
    ids = torch.tensor([[5, 6, 7, 8]])
    loaded = AutoModelForCausalLM.from_pretrained(path / "hf")
    torch.testing.assert_close(loaded(input_ids=ids).logits, bundle.model(input_ids=ids).logits)
    assert (path / "hf" / "tokenizer.json").is_file()
    for step in (2, 3):
        train_step(bundle, step)
        manager.save(step, bundle, {}, export=True, tokenizer=tokenizer)
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-3"]
    newest = AutoModelForCausalLM.from_pretrained(root / "step-3" / "hf")
    for name, value in bundle.model.state_dict().items():
        assert torch.equal(newest.state_dict()[name], value), name
    assert not (Path(manager.save(4, bundle, {})) / "hf").exists()   # export=False: training state only


def test_export_hf_loads_in_transformers(tmp_path):
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=16, intermediate_size=32, num_layers=1)
    out = export_hf(model, tokenizer, tmp_path / "final")
    assert (Path(out) / "model.safetensors").is_file() and (Path(out) / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)    # overwrite: the old export is replaced atomically
    export_hf(model, None, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
    with pytest.raises(TypeError, match="PreTrainedModel"):
        export_hf(torch.nn.Linear(1, 1), None, tmp_path / "bad")


def test_publish_hf_links_the_checkpoint_export_and_survives_its_pruning(tmp_path):
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=16, intermediate_size=32, num_layers=1)
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=1)
    export = Path(manager.save(1, TorchBundle(model), {}, export=True, tokenizer=tokenizer)) / "hf"
    final = Path(publish_hf(export, tmp_path / "final"))
    names = sorted(p.name for p in export.iterdir())
    assert sorted(p.name for p in final.iterdir()) == names
    for name in names:   # the same files, not copies: no second 15 GB on disk for a 7B model
        assert os.path.samefile(final / name, export / name), name
    manager.save(2, TorchBundle(model), {})          # keep_last=1 deletes step-1 and its hf/
    assert not export.exists()
    loaded = AutoModelForCausalLM.from_pretrained(final)
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
    with pytest.raises(FileNotFoundError, match="not a Hugging Face export"):
        publish_hf(tmp_path / "checkpoints" / "step-2", tmp_path / "other")


def test_link_or_copy_copies_where_links_are_refused(tmp_path, monkeypatch):
    source = tmp_path / "a.bin"
    source.write_bytes(b"weights")

    def refuse(*args):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(os, "link", refuse)
    link_or_copy(str(source), str(tmp_path / "b.bin"))
    assert (tmp_path / "b.bin").read_bytes() == b"weights" and not os.path.samefile(source, tmp_path / "b.bin")
