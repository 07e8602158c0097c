"""Run a command as a user at a terminal does: in a pseudo-terminal of its own (stdin, stdout and stderr are the
terminal; its own session, with the terminal as its controlling one), so output is a TTY's and Ctrl-C is the byte
0x03 that the terminal turns into SIGINT for the whole foreground process group, children included."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios
import time
from collections.abc import Callable


def _take_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)   # after setsid (start_new_session): the pty becomes the controlling tty


class TerminalRun:
    """`cmd` running in a pseudo-terminal; `output` is everything it wrote there so far (read while waiting)."""

    def __init__(self, cmd: list[str], env: dict, cwd=None):
        self.master, slave = pty.openpty()
        # a window's size, as a terminal emulator sets it (a bare pty is 0 x 0: tqdm would draw empty bars)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                                     start_new_session=True, preexec_fn=_take_terminal)
        os.close(slave)
        self._output = b""

    def _read(self, timeout: float) -> None:
        while select.select([self.master], [], [], timeout)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:   # EIO: every process holding the terminal has closed it
                return
            if not chunk:
                return
            self._output += chunk
            timeout = 0

    @property
    def output(self) -> str:
        """What the command wrote, with the terminal's CR LF line ends as LF (a bare CR, a progress bar's, stays)."""
        return self._output.decode(errors="replace").replace("\r\n", "\n")

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Read the terminal until `condition()` holds; fail naming `what` if the command ends or time runs out."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the command ended (status {self.proc.returncode}) before {what}:\n" \
                                             f"{self.output[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{self.output[-4000:]}"
            self._read(0.02)

    def ctrl_c(self) -> None:
        """Type Ctrl-C at the terminal."""
        os.write(self.master, b"\x03")

    def wait(self, timeout: float) -> int:
        """The command's exit status, reading its output until it ends (killed after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"still running after {timeout} s:\n{self.output[-4000:]}")
            self._read(0.05)
        self._read(0)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the command's whole process group, and close the terminal."""
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if self.master is not None:
            self._read(0)
            os.close(self.master)
            self.master = None
