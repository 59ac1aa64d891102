"""Retrying an object store's calls through an outage: backoff with jitter, one warning when a store stops answering
and one line when it answers again (never one per retry), and the error that names the store and what failed."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from lightning_accel.storage.urls import redact

__all__ = ["BUGS", "Backoff", "OutageLog", "StoreError", "first_line", "retrying"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors of the calling code, not of the store: raised at once, never retried as an outage.
BUGS = (TypeError, AttributeError, NameError, AssertionError, ImportError)


class StoreError(OSError):
    """An object store did not take or give a file, or reported it with another size or checksum."""


@dataclass
class Backoff:
    """Exponential backoff with jitter: ``first_s``, doubled after each failure up to ``cap_s``."""

    first_s: float = 0.5
    cap_s: float = 30.0
    _next: float = field(default=0.0, init=False)

    def reset(self) -> None:
        self._next = 0.0

    def delay(self) -> float:
        """The wait before the next try (and the one after it is doubled)."""
        self._next = self.first_s if self._next == 0 else min(self._next * 2, self.cap_s)
        return self._next * random.uniform(0.8, 1.0)


class OutageLog:
    """One warning when a store stops answering, one line when it answers again: no storm of retries in the log."""

    def __init__(self, store: str) -> None:
        self.store = redact(store)
        self.since: float | None = None
        self.failures = 0

    def failed(self, err: BaseException, doing: str) -> None:
        self.failures += 1
        if self.since is None:
            self.since = time.monotonic()
            log.warning(
                "object store %s did not answer while %s (%s: %s); retrying with backoff, training goes on and "
                "nothing counts as saved until it is confirmed in the store",
                self.store,
                doing,
                type(err).__name__,
                first_line(err),
            )

    def recovered(self) -> None:
        if self.since is not None:
            log.warning(
                "object store %s answers again after %.1f s (%d failed tries)",
                self.store,
                time.monotonic() - self.since,
                self.failures,
            )
        self.since, self.failures = None, 0


def first_line(err: BaseException) -> str:
    return redact(str(err).strip().splitlines()[0] if str(err).strip() else "")


def retrying(
    action: Callable[[], T],
    outage: OutageLog,
    doing: str,
    deadline: float | None = None,
    backoff: Backoff | None = None,
    give_up: Callable[[], bool] = lambda: False,
    final: tuple[type[BaseException], ...] = (),
) -> T:
    """``action()`` until it succeeds, with backoff; raise :class:`StoreError` past ``deadline`` (monotonic clock),
    once ``give_up()`` says so (a newer checkpoint superseded this one, the fit ended), or at once for an error in
    ``final`` (a bucket that does not exist is not an outage)."""
    backoff = backoff or Backoff()
    while True:
        try:
            result = action()
        except Exception as err:
            # each backend raises its own kinds (botocore's EndpointConnectionError is no OSError): every error of
            # the store's call is retried, a bug of ours is not
            if isinstance(err, BUGS):
                raise
            outage.failed(err, doing)
            wait = backoff.delay()
            if isinstance(err, final) or give_up() or (deadline is not None and time.monotonic() + wait > deadline):
                raise StoreError(f"{doing} on {outage.store} failed: {type(err).__name__}: {first_line(err)}") from err
            time.sleep(wait)
            continue
        outage.recovered()
        return result
