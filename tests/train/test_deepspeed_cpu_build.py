"""erpo.deepspeed_internals.announce_cpu_builds: before DeepSpeed JIT-builds its CPU ops (silent for minutes, and
hanging without a message on a lock a killed build left), one line says so."""
import logging
import os
import time

import pytest
import torch

from erpo.deepspeed_internals import STALE_BUILD_LOCK_S, announce_cpu_builds

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed builds the ops on a CPU machine only")
OPS = ("deepspeed_shm_comm", "fused_adam")


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """{op: its build folder} under a TORCH_EXTENSIONS_DIR of the test's own."""
    pytest.importorskip("deepspeed", exc_type=ModuleNotFoundError)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory
    return {op: _get_build_directory(op, verbose=False) for op in OPS}


def lines(caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="erpo"):
        announce_cpu_builds()
    return [(record.levelno, record.getMessage()) for record in caplog.records]


def built(folder, op):
    open(os.path.join(folder, f"{op}.so"), "w").close()


def test_a_first_build_is_announced_with_its_ops_and_folder(folders, tmp_path, caplog):
    [(level, message)] = lines(caplog)
    assert level == logging.INFO
    assert message == f"DeepSpeed builds its CPU ops deepspeed_shm_comm and fused_adam once, into {tmp_path} " \
                      "(1-3 minutes, no output)"
    built(folders["deepspeed_shm_comm"], "deepspeed_shm_comm")
    [(_, message)] = lines(caplog)
    assert "ops fused_adam once" in message


def test_a_stale_lock_is_named_and_a_fresh_one_is_a_build_under_way(folders, caplog):
    built(folders["fused_adam"], "fused_adam")
    lock = os.path.join(folders["deepspeed_shm_comm"], "lock")
    open(lock, "w").close()
    [(level, _)] = lines(caplog)  # another run's build, just started: the build's line, no warning
    assert level == logging.INFO
    old = time.time() - STALE_BUILD_LOCK_S - 120
    os.utime(lock, (old, old))
    [(level, message)] = lines(caplog)
    assert level == logging.WARNING and lock in message and "delete it" in message


def test_built_ops_say_nothing(folders, caplog):
    for op, folder in folders.items():
        built(folder, op)
    assert lines(caplog) == []
