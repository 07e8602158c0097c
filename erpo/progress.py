"""Progress of a long phase (the SFT warm start, the reference cache, evaluation, training), one mechanism for all:
a tqdm bar when stderr is a terminal; otherwise (a log file, CI) a plain log line every `ERPO_PROGRESS_SECONDS`
seconds (default 30) and one when a phase that logged one ends, instead of a bar's carriage returns."""
from __future__ import annotations

import logging
import math
import os
import sys
import time

log = logging.getLogger("erpo")

PROGRESS_SECONDS_ENV = "ERPO_PROGRESS_SECONDS"
DEFAULT_PROGRESS_SECONDS = 30.0


def progress(total: int, desc: str, unit: str, *, initial: int = 0, enabled: bool = True):
    """A progress display of `total` units (`initial` already done) with tqdm's interface: `update(n)`,
    `set_postfix(**values)`, `close()`, and use as a context manager. `enabled=False`: nothing is shown."""
    from tqdm.auto import tqdm
    if not enabled or sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not enabled)
    return LogProgress(total, desc, unit, initial=initial, seconds=progress_seconds())


def progress_seconds() -> float:
    """Seconds between two progress lines when stderr is not a terminal (env ERPO_PROGRESS_SECONDS, default 30)."""
    raw = os.environ.get(PROGRESS_SECONDS_ENV, "").strip()
    try:
        seconds = float(raw) if raw else DEFAULT_PROGRESS_SECONDS
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:
        raise ValueError(f"{PROGRESS_SECONDS_ENV} must be a number of seconds >= 0, got {raw!r}")
    return seconds


def clock(seconds: float) -> str:
    """`seconds` as M:SS, or H:MM:SS from an hour on."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class LogProgress:
    """Progress as log lines: `DESC: N/TOTAL UNIT (P%), M:SS elapsed, about M:SS left; POSTFIX`, at most one per
    `seconds`, and from `close()` the count reached when it is not the last one logged (a phase shorter than `seconds`
    logs none)."""

    def __init__(self, total: int, desc: str, unit: str, *, initial: int = 0, seconds: float):
        self.total, self.desc, self.unit, self.seconds = total, desc, unit, seconds
        self.n = self.first = initial
        self.started = self.logged_at = time.monotonic()
        self.postfix = ""
        self.logged_n: int | None = None   # the count of the last line logged

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.logged_at >= self.seconds:
            self.logged_at, self.logged_n = now, self.n
            log.info(self.line(now))

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def line(self, now: float) -> str:
        elapsed = now - self.started
        done = self.n - self.first
        text = f"{self.desc}: {self.n}/{self.total} {self.unit} ({100 * self.n / max(self.total, 1):.0f}%), " \
               f"{clock(elapsed)} elapsed"
        if 0 < done and self.n < self.total:
            text += f", about {clock(elapsed / done * (self.total - self.n))} left"
        return f"{text}; {self.postfix}" if self.postfix else text

    def close(self) -> None:
        if self.logged_n is not None and self.logged_n != self.n:
            self.logged_n = self.n
            log.info(self.line(time.monotonic()))

    def __enter__(self) -> "LogProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
