"""What a pytest run's log says, read back: its command, result line, the tests it collected and ran, an early stop
(pytest-timeout's session timeout), its failures and errors, and its `--durations` lines. gpu_check's summary of the
kernel tier (`bench.gpu_check.pytest_summary`) and bench.decide's rule for the tier's time read the same log
(kernel-tests.log) through it.
"""
from __future__ import annotations

import re
import shlex
from typing import NamedTuple, Optional

DURATION = re.compile(r"([\d.]+)s (call|setup|teardown) +(.+)")  # "12.01s setup    tests/kernels/test_x.py::test_y"


class Duration(NamedTuple):
    """One `--durations` line: seconds, the phase (call, setup or teardown), the test's node id and the line."""

    seconds: float
    phase: str
    test: str
    line: str

    @property
    def file(self) -> str:
        """The test's file, as pytest names it (tests/kernels/test_x.py)."""
        return self.test.split("::")[0]


class PytestLog(NamedTuple):
    """command: the argv of the log's first `$ ` line (gpu_check writes it), None without one; result: the last
    result line ("1 failed, 8 passed in 161.40s (0:02:41)"), None when pytest printed none; collected: the tests it
    collected, None if not known; not_run: collected less those with an outcome, None if not known; seconds: pytest's
    own clock in the result line; stopped: the session timeout's line, None if it did not stop the run; failures: the
    FAILED / ERROR lines; durations: the `--durations` lines in the log's order (slowest first)."""

    command: Optional[list]
    result: Optional[str]
    collected: Optional[int]
    not_run: Optional[int]
    seconds: Optional[float]
    stopped: Optional[str]
    failures: list
    durations: list


def read_pytest_log(lines: list) -> PytestLog:
    """The log's lines (`PytestLog`)."""
    commands = [line[2:] for line in lines if line.startswith("$ ")]
    results = [line.strip("= ") for line in lines if re.search(r"\d+ (passed|failed|error|deselected)", line)
               and re.search(r" in [\d.]+s", line)]
    collected = [int(found[1]) for line in lines if (found := re.search(r"(?:^collected |workers \[)(\d+) item", line))]
    result = results[-1] if results else None
    ran = sum(int(count) for count, _ in re.findall(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?)\b",
                                                    result)) if result else 0
    seconds = re.search(r" in ([\d.]+)s", result) if result else None
    return PytestLog(
        command=shlex.split(commands[0]) if commands else None, result=result,
        collected=collected[-1] if collected else None,
        not_run=collected[-1] - ran if result and collected else None,
        seconds=float(seconds[1]) if seconds else None,
        stopped=next((line.strip("! ") for line in reversed(lines)
                      if "session-timeout" in line and line.startswith("!")), None),
        failures=[line for line in lines if line.startswith(("FAILED ", "ERROR "))],
        durations=[Duration(float(found[1]), found[2], found[3].rstrip(), line) for line in lines
                   if (found := DURATION.match(line))])
