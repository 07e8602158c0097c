"""The run directory's lock: one `erpo train` writes a run directory at a time, also across the nodes of a
shared file system.

`OUTPUT_DIR/run.lock` holds JSON {"host", "boot_id", "pid", "pid_start", "since", "command"}. It is written to a
temporary file and linked into place (`os.link` fails when the lock exists: atomic on local file systems and on
NFS, where O_EXCL was not always), so a reader never sees half a lock. While the run lives, a daemon thread touches
the lock every HEARTBEAT_S seconds (its mtime is the heartbeat). Another writer finds the lock and:
- same machine (host name and boot id): refused while the holder's pid runs (and is the same process: its start
  time matches, so a reused pid does not count); taken over with a warning once that process is gone;
- another machine: refused while the heartbeat is younger than STALE_AFTER_S (its processes cannot be seen from
  here); taken over with a warning after that, or at once with `erpo train --force`. The interval assumes the
  nodes' clocks agree to well within it.
Only rank 0 of a multi-rank run takes the lock (`hold_run_dir`); the other ranks learn the outcome from it. The lock
is removed when the run ends, also on an error (atexit); a killed run (SIGKILL, power loss) leaves it for the
next run to take over.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from erpo import distributed as dist_utils
from erpo.errors import UserError

logger = logging.getLogger(__name__)

LOCK_NAME = "run.lock"
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0     # 10 heartbeats: another machine's lock is only taken over after this long without one
TAKEOVER_ATTEMPTS = 8     # rounds of "find a stale lock, move it aside, take ours" while others race for it


class RunDirLocked(UserError):
    """Another live run holds the run directory."""


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks after boot, /proc/PID/stat field 22); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by another user
        return True
    return True


def describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"host {holder.get('host')}, pid {holder.get('pid')}, since {since}: {holder.get('command', '?')}"


class RunLock:
    """The lock of one run directory (see the module doc). `acquire()` takes it or raises RunDirLocked; `release()`
    gives it back (idempotent; also registered with atexit)."""

    def __init__(self, out_dir: str | os.PathLike, *, force: bool = False, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S):
        self.path = Path(out_dir) / LOCK_NAME
        self.force, self.heartbeat_s, self.stale_after_s = force, heartbeat_s, stale_after_s
        self.body = {"host": socket.gethostname(), "boot_id": boot_id(), "pid": os.getpid(),
                     "pid_start": process_start(os.getpid()), "since": time.time(),
                     "command": shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])}
        self.held = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # -- who holds it
    def read(self) -> tuple[dict | None, str | None, float]:
        """(holder, raw text, heartbeat time) of the lock on disk; holder None when the lock is gone (raw None) or
        unreadable."""
        try:
            raw = self.path.read_text()
            heartbeat = self.path.stat().st_mtime
        except FileNotFoundError:
            return None, None, 0.0
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = None
        return (holder if isinstance(holder, dict) else None), raw, heartbeat

    def same_machine(self, holder: dict) -> bool:
        return holder.get("host") == self.body["host"] and holder.get("boot_id") == self.body["boot_id"]

    def is_ours(self, holder: dict | None) -> bool:
        return (holder is not None and self.same_machine(holder) and holder.get("pid") == self.body["pid"]
                and holder.get("pid_start") == self.body["pid_start"])

    def why_stale(self, holder: dict | None, heartbeat: float) -> str | None:
        """Why the lock's holder is dead (None: it may be alive)."""
        if holder is None:
            return "the lock file is unreadable"
        if self.same_machine(holder):
            pid = holder.get("pid")
            if not isinstance(pid, int) or not pid_alive(pid):
                return f"its process {pid} is gone"
            if holder.get("pid_start") not in (None, process_start(pid)):
                return f"its pid {pid} now belongs to another process"
            return None
        age = time.time() - heartbeat
        if age > self.stale_after_s:
            return f"no heartbeat for {age:.0f} s (over {self.stale_after_s:.0f} s)"
        return None

    # -- taking and giving back
    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(TAKEOVER_ATTEMPTS):
            if self._create():
                self._held()
                return self
            holder, raw, heartbeat = self.read()
            if raw is None:             # released between our attempt and the read: try again
                continue
            if self.is_ours(holder):    # this process took it in an earlier run that has not released it yet
                self._held()
                return self
            dead = self.why_stale(holder, heartbeat)
            if dead is None and not self.force:
                raise RunDirLocked(
                    f"--output-dir {self.path.parent}: another run is writing it ({describe(holder)}); wait for it "
                    f"to end or stop it. A lock of another machine is taken over after {self.stale_after_s:.0f} s "
                    f"without a heartbeat, or at once with --force (only when that run is surely dead)")
            reason = dead or "--force"
            if self._move_aside(raw):
                who = describe(holder) if holder else "unknown holder"
                logger.warning("taking over the lock of %s (%s): %s", self.path.parent, reason, who)
        raise RunDirLocked(f"--output-dir {self.path.parent}: could not take its lock ({self.path}): other runs "
                           f"kept taking it ({TAKEOVER_ATTEMPTS} attempts)")

    def _create(self) -> bool:
        """Link a complete lock file into place; False when a lock exists."""
        tmp = self.path.with_name(f".{LOCK_NAME}.{os.getpid()}.{uuid.uuid4().hex[:12]}")
        with open(tmp, "w") as handle:
            json.dump(self.body, handle)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def _move_aside(self, raw: str) -> bool:
        """Remove the stale lock whose text is `raw`. Renamed aside first: if another process replaced it in the
        meantime (its own fresh lock), that one is put back and False returned."""
        aside = self.path.with_name(f".{LOCK_NAME}.stale.{os.getpid()}.{uuid.uuid4().hex[:12]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        if aside.read_text() != raw:
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink()
            return False
        aside.unlink()
        return True

    def _held(self) -> None:
        self.held = True
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, name="erpo-run-lock-heartbeat", daemon=True)
        self._heartbeat.start()
        atexit.register(self.release)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            holder, _, _ = self.read()
            if not self.is_ours(holder):
                logger.error("the lock of %s was taken by %s: another run now writes this directory too",
                             self.path.parent, describe(holder) if holder else "nobody")
                return
            os.utime(self.path)

    def release(self) -> None:
        """Remove the lock if this process still holds it."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        atexit.unregister(self.release)
        holder, _, _ = self.read()
        if self.is_ours(holder):
            self.path.unlink(missing_ok=True)


def hold_run_dir(out_dir: str | os.PathLike, *, force: bool = False) -> RunLock | None:
    """Rank 0 creates `out_dir` and takes its lock; every rank raises the same RunDirLocked (or UserError) when that
    fails. Returns the held lock on rank 0, None on the other ranks. Collective."""
    lock, failure = None, None
    if dist_utils.is_main():
        try:
            lock = RunLock(out_dir, force=force).acquire()
        except RunDirLocked as exc:
            failure = str(exc)
        except OSError as exc:
            failure = f"--output-dir {out_dir}: cannot write it ({exc.strerror or exc})"
    failure = dist_utils.all_gather_object(failure)[0]
    if failure:
        raise RunDirLocked(failure)
    return lock
