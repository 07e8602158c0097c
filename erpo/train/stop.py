"""A graceful stop: SIGTERM (by default) becomes a request, agreed over ranks, to stop after the current step."""
from __future__ import annotations

import logging
import signal
from collections.abc import Iterable
from typing import Any

from erpo import distributed as dist_utils

logger = logging.getLogger(__name__)


class GracefulStop:
    """Turns SIGTERM (by default) into a request to stop after the current step.

    Usage:
        with GracefulStop() as stop:
            for step in ...:
                train_step()
                if stop.should_stop():          # collective: every rank, same place, every step
                    manager.save(step, engine, state); break

    `.requested` is True once a signal arrived on this rank. A second signal of the same kind gets the
    previous handler (by default: terminate at once). Install from the main thread.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)):
        self.signals = tuple(signals)
        if not self.signals:
            raise ValueError("signals must name at least one signal")
        self.requested = False
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def handle(self, signum, frame) -> None:
        self.requested = True
        self.received = signum
        logger.warning("received %s: finishing the current step, saving a checkpoint, then exiting",
                       signal.Signals(signum).name)
        signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))

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
