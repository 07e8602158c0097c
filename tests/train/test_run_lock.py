"""erpo.train.run_lock: one writer per run directory. A live holder on this machine is refused in one line naming it; a
dead one (pid gone, or reused) is taken over with a warning; another machine's lock only after its heartbeat is
older than the staleness interval, or with force. The end-to-end case (`erpo train --resume` beside a live run,
then after it was SIGKILLed) is in tests/train/test_storage_faults.py."""
import json
import logging
import os
import subprocess
import sys
import time

import pytest

from erpo.errors import UserError
from erpo.train.run_lock import LOCK_NAME, RunDirLocked, RunLock, hold_run_dir, process_start


def write_lock(run_dir, **fields):
    """A lock as another process wrote it: this machine's identity unless `fields` say otherwise."""
    body = {**RunLock(run_dir).body, **fields}
    (run_dir / LOCK_NAME).write_text(json.dumps(body))
    return body


@pytest.fixture
def other_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def test_acquire_writes_who_holds_it_and_release_removes_it(tmp_path):
    lock = RunLock(tmp_path / "run").acquire()
    body = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert body["pid"] == os.getpid() and body["host"] == lock.body["host"] and "command" in body
    again = RunLock(tmp_path / "run").acquire()
    assert again.held                                    # this same process: taken again, not refused
    lock.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []   # no temporary file left either
    lock.release()                                       # idempotent
    again.release()   # its heartbeat stopped: it would log "taken by nobody" at the next beat, in a later test


def test_a_live_holder_on_this_machine_is_refused_then_taken_over_once_dead(tmp_path, other_process, caplog):
    holder = write_lock(tmp_path, pid=other_process.pid, pid_start=process_start(other_process.pid))
    with pytest.raises(RunDirLocked) as info:
        RunLock(tmp_path).acquire()
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message
    assert f"another run is writing it (host {holder['host']}, pid {other_process.pid}, since " in message
    other_process.kill()
    other_process.wait()
    with caplog.at_level(logging.WARNING):
        lock = RunLock(tmp_path).acquire()
    assert [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()] == [
        f"taking over the lock of {tmp_path} (its process {other_process.pid} is gone): "
        f"host {holder['host']}, pid {other_process.pid}, since "
        + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"])) + f": {holder['command']}"]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_reused_pid_does_not_keep_a_lock(tmp_path, other_process):
    write_lock(tmp_path, pid=other_process.pid, pid_start="1")   # that pid now runs another process
    RunLock(tmp_path).acquire().release()


def test_another_machine_is_trusted_until_its_heartbeat_is_stale(tmp_path, caplog):
    write_lock(tmp_path, host="node-7", pid=1)
    with pytest.raises(RunDirLocked, match="host node-7, pid 1, since .*taken over after 600 s without a heartbeat, "
                                           "or at once with --force"):
        RunLock(tmp_path).acquire()
    old = time.time() - 601
    os.utime(tmp_path / LOCK_NAME, (old, old))
    with caplog.at_level(logging.WARNING):
        RunLock(tmp_path).acquire().release()
    assert any("no heartbeat for 601 s (over 600 s)" in r.getMessage() for r in caplog.records)
    write_lock(tmp_path, host="node-7", pid=1)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        RunLock(tmp_path, force=True).acquire().release()
    assert any("(--force): host node-7" in r.getMessage() for r in caplog.records)


def test_an_unreadable_lock_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text('{"host": "node-')
    RunLock(tmp_path).acquire().release()


def test_the_heartbeat_refreshes_the_lock_and_notices_a_takeover(tmp_path, caplog):
    lock = RunLock(tmp_path, heartbeat_s=0.05).acquire()
    old = time.time() - 1000
    os.utime(tmp_path / LOCK_NAME, (old, old))
    deadline = time.monotonic() + 10
    while (tmp_path / LOCK_NAME).stat().st_mtime < time.time() - 100:
        assert time.monotonic() < deadline, "the heartbeat never touched the lock"
        time.sleep(0.02)
    write_lock(tmp_path, host="node-7", pid=1)            # someone forced it away from us
    with caplog.at_level(logging.ERROR):
        deadline = time.monotonic() + 10
        while not any("was taken by host node-7" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "node-7"   # not ours: left in place


def test_hold_run_dir_creates_the_directory_and_names_the_holder(tmp_path, other_process):
    lock = hold_run_dir(tmp_path / "new" / "run")
    assert lock.held and (tmp_path / "new" / "run" / LOCK_NAME).is_file()
    lock.release()
    write_lock(tmp_path, pid=other_process.pid, pid_start=process_start(other_process.pid))
    with pytest.raises(RunDirLocked, match=f"pid {other_process.pid}"):
        hold_run_dir(tmp_path)
