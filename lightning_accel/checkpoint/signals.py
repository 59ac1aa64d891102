"""Stop signals for one fit: register a handler that only raises a flag, chain the handlers it replaced, restore.

Modelled on Lightning's ``trainer/connectors/signal_connector.py``: handlers found in place when the fit is set up
(a user's, a launcher agent's) are called by ours after the flag is raised; at the end of the fit what was there is
put back, and only where ours is still installed (Lightning's teardown may already have restored its own).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

Handler = Callable[[int, FrameType | None], Any]


def parse_signal(name: str | int) -> signal.Signals:
    """``"SIGTERM"`` (or a number) as a :class:`signal.Signals`; a clear error for anything else."""
    try:
        return signal.Signals[name] if isinstance(name, str) else signal.Signals(name)
    except (KeyError, ValueError) as err:
        raise ValueError(f"Unknown signal {name!r}; use names like 'SIGTERM' or 'SIGUSR1'") from err


def on_main_thread() -> bool:
    """Python installs signal handlers from the main thread only."""
    return threading.current_thread() is threading.main_thread()


class StopSignals:
    """A flag raised by any of ``signals``; the previous handlers are chained and restored.

    ``received`` is the last signal number seen (``None``: none yet). Call :meth:`remember_previous` when the
    fit is set up, :meth:`install` when training is about to run (again after Lightning installs its own
    handlers), and :meth:`restore` when the fit has ended (normally or by an exception).
    """

    def __init__(self, signals: Iterable[str | int]) -> None:
        self.signals = [parse_signal(s) for s in signals]
        self.received: int | None = None
        self.reason: str | None = None  # a stop requested without a signal (a cloud's preemption notice)
        self._chained: dict[int, Handler] = {}

    def reset(self) -> None:
        self.received, self.reason = None, None

    def request(self, reason: str) -> None:
        """Raise the flag without a signal (from any thread): the owner stops at its next safe point."""
        self.reason = reason
        self.received = 0

    def remember_previous(self) -> None:
        """Keep the handlers in place now (not Python's default KeyboardInterrupt one) to call from ours."""
        self._chained = {}
        for sig in self.signals:
            previous = signal.getsignal(sig)
            if callable(previous) and previous is not signal.default_int_handler:
                self._chained[sig] = previous

    def install(self) -> bool:
        """Install the flag handler; ``False`` (nothing installed) off the main thread."""
        if not on_main_thread():
            return False
        for sig in self.signals:
            if signal.getsignal(sig) != self.handle:
                signal.signal(sig, self.handle)
        return True

    def restore(self) -> None:
        """Put back what ours replaced, where ours is still installed."""
        if not on_main_thread():
            return
        for sig in self.signals:
            if signal.getsignal(sig) == self.handle:
                signal.signal(sig, self.previous(sig))

    def previous(self, sig: int) -> Any:
        """The handler ours replaced (the default when there was none to chain)."""
        return self._chained.get(sig, signal.SIG_DFL)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # only a flag: the owner decides at a safe point what happens
        chained = self._chained.get(signum)
        if chained is not None:
            chained(signum, frame)

    def name(self) -> str:
        if self.reason is not None:
            return self.reason
        return signal.Signals(self.received).name if self.received else "a peer rank's signal"
