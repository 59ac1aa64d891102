"""Stop signals for one fit: register a handler that only raises a flag, chain the handlers it replaced, restore.

Modelled on Lightning's ``trainer/connectors/signal_connector.py``: handlers found in place when the fit is set up
(a user's, a launcher agent's) are called by ours after the flag is raised; at the end of the fit what was there is
put back, and only where ours is still installed (Lightning's teardown may already have restored its own).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType
from typing import Any

from lightning_accel._compat import set_handler_after_fit

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "Handler",
    "Preempted",
    "StopSignals",
    "on_main_thread",
    "parse_signal",
]

log = logging.getLogger(__name__)

Handler = Callable[[int, FrameType | None], Any]

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again". Schedulers and wrapper scripts can
# tell a preempted run (requeue it) from a crash (1) or success (0).
PREEMPTED_EXIT_CODE = 75  # named like monitor.sentinel.HANG_EXIT_CODE (76); both exported at the top level
EXIT_CODE_PREEMPTED = PREEMPTED_EXIT_CODE  # the earlier name, kept for scripts that import it


class Preempted(SystemExit):
    """Raised out of ``trainer.fit()`` right after a preemption checkpoint was written.

    A ``SystemExit`` whose ``code`` is the exit code (75), so a script ends with that status and no
    traceback; a notebook or a sweep catches it with ``except Preempted``. ``checkpoint`` is the file
    written (``None`` when the signal came before any training step, so there was nothing new to save); with a
    bucket ``dirpath``, the URL of the newest checkpoint confirmed in the store (the previous one when the final
    upload missed the deadline).
    """

    def __init__(self, code: int, checkpoint: Path | str | None) -> None:
        super().__init__(code)
        self.checkpoint = checkpoint


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
        self.received_at: float | None = None  # monotonic clock: when the grace period (or notice lead) began
        self.reason: str | None = None  # a stop requested without a signal (a cloud's preemption notice)
        self._chained: dict[int, Handler] = {}

    def reset(self) -> None:
        self.received, self.received_at, self.reason = None, None, None

    def request(self, reason: str) -> None:
        """Raise the flag without a signal (from any thread): the owner stops at its next safe point."""
        self.reason = reason
        self.received = 0
        self.received_at = time.monotonic()

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

    def install_for_fit(self, trainer: Any) -> bool:
        """:meth:`install`, and have Lightning's teardown put ours back rather than the handlers it found when the fit
        started: it does so before on_fit_end and the teardown hooks run, and a signal then must not kill the process
        inside ``fit()``. Our teardown (:meth:`restore`) or :meth:`restore_after_fit` puts back the previous ones."""
        if not self.install():
            return False
        for sig in self.signals:
            set_handler_after_fit(trainer, sig, self.handle)
        return True

    def restore_after_fit(self, trainer: Any) -> None:
        """:meth:`restore` now, and have Lightning's teardown (after an exception) put back the previous handlers."""
        self.restore()
        for sig in self.signals:
            set_handler_after_fit(trainer, sig, self.previous(sig))

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
        self.received_at = time.monotonic()
        chained = self._chained.get(signum)
        if chained is not None:
            chained(signum, frame)

    def name(self) -> str:
        if self.reason is not None:
            return self.reason
        return signal.Signals(self.received).name if self.received else "a peer rank's signal"
