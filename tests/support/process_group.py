"""A launched process and everything it starts (torchrun's or the DeepSpeed launcher's ranks, a build's compilers), in
a session of its own, so that a test can end all of them at once: on the launch's timeout, on a failed assertion while
it runs, on Ctrl+C. Killing only the launcher (what `subprocess.run(timeout=...)` does) leaves its ranks running on
the shared cores for the rest of the suite. Also whether a process still runs (`running`, `wait_gone`)."""
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL every process left in `process`'s group (its session: `launched`), then reap `process` itself."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@contextlib.contextmanager
def launched(command: list, **popen: object) -> Iterator[subprocess.Popen]:
    """`subprocess.Popen(command, **popen)` as the leader of a new session; on leaving the block, by any way (its end,
    an exception, KeyboardInterrupt), what is left of its process group is killed."""
    with subprocess.Popen(command, start_new_session=True, **popen) as process:
        try:
            yield process
        finally:
            kill_group(process)


def run_group(command: list, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)`, except that the whole
    process group goes (`launched`): on the timeout (TimeoutExpired, as subprocess.run raises), on Ctrl+C, and the
    processes the command leaves behind once it has ended."""
    with launched(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def running(pid: int) -> bool:
    """Whether process `pid` runs: it exists and is no zombie (ended, not yet reaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float) -> float:
    """Seconds until none of `pids` runs any more (AssertionError naming those left after `timeout` seconds)."""
    start = time.monotonic()
    while any(running(pid) for pid in pids):
        assert time.monotonic() - start < timeout, [pid for pid in pids if running(pid)]
        time.sleep(0.05)
    return time.monotonic() - start
