"""erpo.manifest and erpo.storage_errors at the CheckpointManager level (one process, plain torch):
every checkpoint lists its files with size and SHA-256 in meta.json; a truncated or bit-flipped file in the newest
checkpoint (model, optimizer, RNG state, meta.json, the HF export) is skipped with one warning naming it and the
previous checkpoint restores training exactly; all damaged: one DamagedCheckpointError; a save the storage
refuses (a real full tmpfs where this machine lets us mount one) is one StorageError and leaves the previous
checkpoint loadable."""
import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import uuid

import pytest
import torch

from damage import flip_bit, truncate
from erpo.errors import UserError
from erpo.eval.model_specs import resolve_model
from erpo.manifest import DamagedCheckpointError, newest_sound_meta, rank_share, read_meta, require_intact
from erpo.models.tiny import build_tokenizer
from erpo.storage_errors import StorageError, stop_on_storage_failure, storage_problem
from erpo.train.checkpoint import CheckpointManager, TorchBundle
from test_checkpoint import tiny_bundle, train_step


@pytest.fixture
def two_checkpoints(tmp_path):
    """Checkpoints step-1 and step-2 (with HF exports) of a tiny model trained one step between them; the state dict
    of step 1 and what training from it yields."""
    tokenizer = build_tokenizer()
    bundle = tiny_bundle()
    manager = CheckpointManager(tmp_path, keep_last=None)
    train_step(bundle, 0)
    manager.save(1, bundle, {"at": 1}, export=True, tokenizer=tokenizer)
    at_step1 = {k: v.clone() for k, v in bundle.model.state_dict().items()}
    next_loss = train_step(bundle, 1)
    manager.save(2, bundle, {"at": 2}, export=True, tokenizer=tokenizer)
    return manager, at_step1, next_loss


def test_manifest_lists_every_file_with_size_and_sha256(two_checkpoints):
    manager, _, _ = two_checkpoints
    step2 = manager.root / "step-2"
    meta = json.loads((step2 / "meta.json").read_text())
    on_disk = sorted(p.relative_to(step2).as_posix() for p in step2.rglob("*") if p.is_file())
    assert sorted(meta["files"]) == [name for name in on_disk if name != "meta.json"]
    assert {"model.pt", "optimizer.pt", "scheduler.pt", "rng/rank-0.pt", "hf/model.safetensors"} <= set(meta["files"])
    for name, entry in meta["files"].items():
        data = (step2 / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    assert meta["meta_sha256"] == hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def test_rank_share_splits_the_bytes_and_covers_every_file():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10, "e": 0}
    shares = [rank_share(sizes, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(sizes) and not set(shares[0]) & set(shares[1])
    assert sorted(sum(sizes[n] for n in share) for share in shares) == [110, 110]
    assert rank_share(sizes, 0, 1) == ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize("damage", [truncate, flip_bit])
@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt", "rng/rank-0.pt", "meta.json", "hf/model.safetensors"])
def test_damaged_newest_checkpoint_is_skipped_and_the_previous_restores_exactly(two_checkpoints, caplog, name,
                                                                                 damage):
    manager, at_step1, next_loss = two_checkpoints
    damage(manager.root / "step-2" / name)
    fresh = tiny_bundle(seed=1)
    with caplog.at_level(logging.WARNING):
        state = manager.load(fresh)
    assert state == {"at": 1, "step": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "step-2 is damaged" in warnings[0] and name in warnings[0] and "damaged-step-2" in warnings[0]
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, at_step1[key]), key
    assert train_step(fresh, 1) == next_loss                 # optimizer and schedule of step 1 restored too
    assert sorted(p.name for p in manager.root.iterdir()) == ["damaged-step-2", "step-1"]
    manager.save(2, fresh, {"at": 2})                        # the step is saved afresh, not the damaged one reused
    assert manager.load(tiny_bundle(seed=2)) == {"at": 2, "step": 2}


def test_no_intact_checkpoint_is_one_error_and_nothing_moves(two_checkpoints):
    manager, _, _ = two_checkpoints
    flip_bit(manager.root / "step-2" / "optimizer.pt")
    truncate(manager.root / "step-1" / "rng" / "rank-0.pt")
    with pytest.raises(DamagedCheckpointError) as info:
        manager.load(tiny_bundle(seed=1))
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message
    assert f"no intact checkpoint under {manager.root}" in message
    assert "step-2: optimizer.pt: its content does not match its sha256" in message
    assert "step-1: rng/rank-0.pt:" in message and "expected (truncated" in message
    assert sorted(p.name for p in manager.root.iterdir()) == ["step-1", "step-2"]
    # the quick check before any model loads reads meta.json and sizes only: a flipped bit is left to load
    checkpoints = [manager.root / "step-1", manager.root / "step-2"]
    assert newest_sound_meta(checkpoints)["step"] == 2
    truncate(manager.root / "step-2" / "model.pt")
    with pytest.raises(DamagedCheckpointError, match="step-2: model.pt: .*; step-1: rng/rank-0.pt"):
        newest_sound_meta(checkpoints)
    with pytest.raises(DamagedCheckpointError, match=r"step-2 is damaged: model.pt: "):  # a named checkpoint
        manager.load(tiny_bundle(seed=1), manager.root / "step-2")


def test_a_missing_file_and_an_older_checkpoint_without_manifest(two_checkpoints, caplog):
    manager, _, _ = two_checkpoints
    (manager.root / "step-2" / "scheduler.pt").unlink()
    assert newest_sound_meta([manager.root / "step-1", manager.root / "step-2"])["state"] == {"at": 1}
    meta_file = manager.root / "step-1" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["meta_sha256"]                                  # a manifest without its seal: damaged
    meta_file.write_text(json.dumps(meta))
    assert read_meta(manager.root / "step-1") == (None, "meta.json: its digest (meta_sha256) is missing")
    del meta["files"]                                        # as an erpo without manifests wrote it
    meta_file.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        assert manager.load(tiny_bundle(seed=1)) == {"at": 1, "step": 1}
    messages = [r.getMessage() for r in caplog.records]
    assert any("scheduler.pt: No such file" in m for m in messages)
    assert any("has no manifest" in m for m in messages)


def test_erpo_eval_refuses_a_checkpoint_whose_export_is_damaged(two_checkpoints):
    manager, _, _ = two_checkpoints
    assert resolve_model(str(manager.root / "step-2")).path == str(manager.root / "step-2" / "hf")
    flip_bit(manager.root / "step-2" / "hf" / "model.safetensors")
    truncate(manager.root / "step-2" / "optimizer.pt")        # not read by eval: not its concern
    with pytest.raises(DamagedCheckpointError, match="step-2 is damaged: hf/model.safetensors: its content"):
        resolve_model(str(manager.root / "step-2"))


# ------------------------------------------------------------------------------------------ storage failures

def test_storage_problem_reads_the_three_ways_libraries_report_a_full_disk(tmp_path, monkeypatch):
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x.pt"))
    assert storage_problem(enospc, tmp_path) == f"{tmp_path / 'x.pt'}: No space left on device"
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.EIO, "Input/output error")
    assert storage_problem(wrapped, tmp_path) == f"{tmp_path}: Input/output error"
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert storage_problem(rust, tmp_path) == f"{tmp_path}: No space left on device"
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    monkeypatch.setattr("erpo.storage_errors.free_bytes", lambda directory: 0)
    assert storage_problem(torch_error, tmp_path) == f"{tmp_path}: No space left on device"
    monkeypatch.setattr("erpo.storage_errors.free_bytes", lambda directory: 10**12)
    assert "torch.save could not write (" in storage_problem(torch_error, tmp_path)
    assert storage_problem(ValueError("a bug"), tmp_path) is None
    assert storage_problem(OSError(errno.ENOENT, "No such file"), tmp_path) is None
    with pytest.raises(ValueError, match="a bug"), stop_on_storage_failure("saving", tmp_path):
        raise ValueError("a bug")                            # not a storage failure: the traceback stays
    with pytest.raises(StorageError, match="^saving step-2 failed: .*x.pt: No space") as info, \
            stop_on_storage_failure("a file operation", tmp_path, advice="x"), \
            stop_on_storage_failure("saving step-2", tmp_path):
        raise enospc                                         # the innermost block names it; the outer ones pass it
    assert info.value.__cause__ is enospc


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs: a real file system that fills up (needs the right to mount; skipped elsewhere)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", f"erpo-test-{uuid.uuid4().hex[:8]}", str(mount)],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)   # lazy: a failed writer may still hold a file


def test_a_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_loads(small_tmpfs):
    model = torch.nn.Linear(128, 128)                          # model.pt ~66 kB, optimizer.pt ~130 kB
    bundle = TorchBundle(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    manager = CheckpointManager(small_tmpfs, keep_last=None)
    model(torch.randn(2, 128)).sum().backward()
    bundle.optimizer.step()
    manager.save(1, bundle, {"at": 1})
    at_step1 = {k: v.clone() for k, v in model.state_dict().items()}
    free = shutil.disk_usage(small_tmpfs).free
    (small_tmpfs / "filler").write_bytes(b"\0" * (free - 100_000))   # room for part of the next save only
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(StorageError) as info, stop_on_storage_failure("saving checkpoint step-2", manager.root):
        manager.save(2, bundle, {"at": 2})
    message = str(info.value)
    assert message.startswith("saving checkpoint step-2 failed: ") and "No space left on device" in message
    assert str(manager.root) in message and "\n" not in message
    assert sorted(p.name for p in manager.root.iterdir()) == ["step-1"]   # the partial save was removed
    fresh = torch.nn.Linear(128, 128)
    assert manager.load(TorchBundle(fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1))) == {"at": 1, "step": 1}
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in at_step1.items())
    require_intact(manager.root / "step-1")
