"""math-verify in a child process: `erpo.tasks.rewards` runs `python -m erpo.tasks.answer_worker`, writes one JSON line
[prediction, gold] per answer to its stdin and reads back one JSON line, true or false, or {"error": MESSAGE} where
math-verify raised.

The parent bounds each answer's wall-clock time itself and kills this process when an answer runs over
(`erpo.tasks.rewards.AnswerChecker`): math-verify's own timeouts use SIGALRM, which works only in a process's main
thread (a reward called from any other thread raised), and an alarm cannot stop a computation stuck in C.
So they are off here. Imports nothing from erpo but this module, so it starts as fast as math-verify imports.

First line written: {"ready": VERSION} once math-verify is imported, or {"import_error": MESSAGE}.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time

TEXT_COMMANDS = ("text", "textbf", "mathrm", "mbox")      # LaTeX commands that wrap plain text in answers
_NESTED_TEXT = re.compile(r"\\(%s)\{\\(?:%s)\{([^{}]*)\}\}" % ("|".join(TEXT_COMMANDS), "|".join(TEXT_COMMANDS)))


def collapse_nested_text(s: str) -> str:
    """\\text{\\textbf{(B)}} -> \\text{(B)}, innermost first. math-verify 0.9.0 unwraps one text command but
    keeps one nested in another as an unparsed string, which then equals neither (B) nor B."""
    while True:
        s, count = _NESTED_TEXT.subn(r"\\\1{\2}", s)
        if not count:
            return s


def math_verify_match(pred: str, gold: str) -> bool:
    """Whether math-verify judges `pred` equal to the reference answer `gold` (each read as LaTeX math), with
    its own timeouts off: call it where the caller bounds the time (this process, killed from outside)."""
    from math_verify import parse, verify

    gold_parsed = parse(f"${collapse_nested_text(gold)}$", parsing_timeout=None)
    pred_parsed = parse(f"${collapse_nested_text(pred)}$", parsing_timeout=None)
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _exit_when_orphaned(parent: int) -> None:
    """A parent killed while this process works on a runaway answer would leave it computing on: exit instead."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    # A terminal's Ctrl-C reaches the whole process group: the parent says what stopped and ends this process
    # (closes its stdin, or kills it), so it prints no traceback of its own. So does a SIGTERM sent to the group
    # (`timeout`, `kill -TERM -PGID`, a batch scheduler's preemption), after which the trainer finishes its step
    # and saves a checkpoint: this process answers on until the parent ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # math-verify warns that its timeouts are off, and on failed parses: the parent bounds the time and judges.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    try:
        from importlib.metadata import version

        import math_verify  # noqa: F401
        ready = {"ready": version("math-verify")}
    except Exception as exc:   # not installed, or a broken install (a dependency missing or too new)
        ready = {"import_error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(ready), flush=True)
    if "import_error" in ready:
        return
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    for line in sys.stdin:
        pred, gold = json.loads(line)
        try:
            verdict = math_verify_match(pred, gold)
        except Exception as exc:   # math-verify catches its own errors; the parent logs anything else, as wrong
            verdict = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps(verdict), flush=True)


if __name__ == "__main__":
    main()
