"""A graceful stop: SIGTERM or SIGINT (a terminal's Ctrl-C) becomes a request, agreed over ranks, to stop after the
current step; `Interrupted` (erpo.errors) is how a run stopped by Ctrl-C ends (the `erpo` command exits
erpo.errors.INTERRUPTED_EXIT_STATUS, 130, as a shell expects)."""
from __future__ import annotations

import logging
import signal
from collections.abc import Iterable
from typing import Any

from erpo import distributed as dist_utils
from erpo.errors import Interrupted

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """Turns SIGTERM and SIGINT (by default) into a request to stop after the current step.

    Usage:
        with GracefulStop() as stop:
            for step in ...:
                train_step()
                if stop.should_stop():          # collective: every rank, same place, every step
                    manager.save(step, engine, state); break

    `.requested` is True once a signal arrived on this rank, `.received` says which. A second signal of the same
    kind gets the previous handler (under the `erpo` command: SIGTERM raises erpo.errors.Terminated, SIGINT
    KeyboardInterrupt, where the program is; Python's default for SIGTERM terminates at once). Install from the main
    thread.
    """

    def __init__(self, signals: Iterable[int] = STOP_SIGNALS):
        self.signals = tuple(signals)
        if not self.signals:
            raise ValueError("signals must name at least one signal")
        self.requested = False
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def handle(self, signum, frame) -> None:
        self.requested = True
        self.received = signum
        # the second signal's handler first, then the line that promises it: a user (or a test) who answers the line
        # at once must find it in place
        signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))
        again = "Ctrl-C again" if signum == signal.SIGINT else f"a second {signal.Signals(signum).name}"
        logger.warning("received %s: finishing the current step, saving a checkpoint, then exiting (%s stops at "
                       "once, losing the steps after the newest checkpoint)", signal.Signals(signum).name, again)

    def install(self) -> "GracefulStop":
        for signum in self.signals:
            self.previous[signum] = signal.signal(signum, self.handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()

    def __enter__(self) -> "GracefulStop":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def should_stop(self) -> bool:
        """True on every rank when any rank was signalled (all-reduced, so ranks stop at the same step)."""
        return bool(dist_utils.all_reduce_sum(int(self.requested)))

    def raise_if_interrupted(self, message: str) -> None:
        """After a stop that SIGINT requested on this rank: raise `Interrupted(message)` (exit status 130). A stop
        by SIGTERM (or by another rank's signal) returns: the run ended as asked, exit status 0."""
        if self.received == signal.SIGINT:
            raise Interrupted(message)
