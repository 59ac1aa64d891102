"""IdleMonitor: machines that are paid for and train nothing, said loudly, and optionally a command of yours.

Two kinds of waste no other signal shows: a fit that makes no optimizer step for a long time (stuck in
validation, waiting on data, a notebook paused at a breakpoint) and a process that lives on after its fit has
finished (a notebook, a script that goes on to wait for something). Each is logged at ERROR, exported as a
Prometheus series, and can run a command you give (a shutdown script, a notification). Nothing runs unless
configured.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_accel.monitor.exporter import PrometheusExporter, resolve_exporter

__all__ = ["IDLE_KEYS", "Command", "IdleMonitor"]

log = logging.getLogger(__name__)

IDLE_KEYS = ("idle/seconds_since_step", "idle/finished")
Command = str | Sequence[str]


class IdleMonitor(Callback):
    """Say when a run pays for machines that train nothing, and optionally act.

    Args:
        idle_after_s: Seconds without an optimizer step (during fit, or since the fit ended) after which the run
            counts as idle: logged at ERROR, then again every ``idle_after_s`` while it lasts.
        on_idle: A command (a string split like a shell does, or a list) run once when the run first counts as
            idle. ``None``: nothing runs.
        after_fit: A command run once when ``fit`` has ended (normally or not). ``None``: nothing runs.
        watch_after_fit: Keep watching after the fit, so a process that outlives its training is reported.
        poll_s: How often the watch thread looks.
        prometheus: A :class:`PrometheusExporter` (shared with other monitors) or a port: ``idle/seconds_since_step``
            and ``idle/finished`` (1 once the fit has ended).

    Commands run on one process per node (local rank 0), with ``LIGHTNING_ACCEL_IDLE_REASON`` in their
    environment (``idle`` or ``finished``); their exit code is logged, and they never stop training.
    """

    def __init__(
        self,
        idle_after_s: float = 1800.0,
        on_idle: Command | None = None,
        after_fit: Command | None = None,
        watch_after_fit: bool = True,
        poll_s: float = 5.0,
        prometheus: PrometheusExporter | int | None = None,
    ) -> None:
        if idle_after_s <= 0 or poll_s <= 0:
            raise ValueError(f"IdleMonitor: idle_after_s and poll_s must be > 0, got {idle_after_s} and {poll_s}")
        self.idle_after_s, self.poll_s, self.watch_after_fit = idle_after_s, poll_s, watch_after_fit
        self.on_idle, self.after_fit = _split(on_idle), _split(after_fit)
        self.exporter, self._owns_exporter = resolve_exporter(prometheus)
        self.alarms = 0  # idle reports so far
        self.ran: list[tuple[str, int]] = []  # (reason, exit code) of each command run
        self.finished = False
        self._last_step = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._stop.set()  # a watch left over from an earlier fit of this callback
        self._stop = threading.Event()
        self._rank, self._local_rank = trainer.global_rank, trainer.local_rank
        self.finished, self._last_step, self._ran_on_idle = False, time.monotonic(), False
        self._thread = threading.Thread(target=self._watch, name="lightning_accel-idle", daemon=True)
        self._thread.start()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.exporter is not None:
            self.exporter.follow_fit(trainer)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        self._last_step = time.monotonic()  # a plain write: this hook is on the hot path

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_ended()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._fit_ended()

    def _fit_ended(self) -> None:
        if self.finished:
            return
        self.finished, self._last_step = True, time.monotonic()
        log.warning(
            "IdleMonitor: training has finished%s",
            "; every minute this process lives on is paid for and trains nothing" if self.watch_after_fit else "",
        )
        self._run(self.after_fit, "finished")
        self._export()
        if not self.watch_after_fit:
            self._stop.set()

    def _watch(self) -> None:
        reported_at = 0.0
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last_step
            self._export(idle)
            if idle < self.idle_after_s:
                reported_at = 0.0  # stepping again: the next idle spell is reported afresh
                continue
            if idle - reported_at < self.idle_after_s:
                continue  # reported less than idle_after_s ago
            reported_at = idle
            self.alarms += 1
            what = "since training finished" if self.finished else "without an optimizer step"
            log.error(
                "IdleMonitor: %.1f min %s on rank %d: the machines are paid for and train nothing%s",
                idle / 60,
                what,
                self._rank,
                "" if self.on_idle or self._ran_on_idle else " (IdleMonitor(on_idle=...) can run a command then)",
            )
            if not self._ran_on_idle:
                self._ran_on_idle = True
                self._run(self.on_idle, "idle")

    def _export(self, idle: float | None = None) -> None:
        if self.exporter is None:
            return
        seconds = time.monotonic() - self._last_step if idle is None else idle
        metrics = {"idle/seconds_since_step": seconds, "idle/finished": float(self.finished)}
        try:
            self.exporter.publish(metrics, rank=self._rank, local_rank=self._local_rank)
        except OSError as error:
            log.warning("IdleMonitor: cannot export to Prometheus: %s", error)

    def _run(self, command: list[str] | None, reason: str) -> None:
        if command is None or self._local_rank != 0:
            return
        log.warning("IdleMonitor: running %s (%s)", shlex.join(command), reason)
        try:
            done = subprocess.run(command, env={**os.environ, "LIGHTNING_ACCEL_IDLE_REASON": reason}, check=False)
            code = done.returncode
        except OSError as error:
            log.error("IdleMonitor: could not run %s: %s", shlex.join(command), error)
            code = -1
        self.ran.append((reason, code))
        log.warning("IdleMonitor: %s exited with %d", shlex.join(command), code)

    def close(self) -> None:
        """Stop watching (and close an exporter this monitor owns)."""
        self._stop.set()
        if self._owns_exporter and self.exporter is not None:
            self.exporter.close()


def _split(command: Command | None) -> list[str] | None:
    if command is None:
        return None
    parts = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    if not parts:
        raise ValueError("IdleMonitor: an empty command; give None to run nothing")
    return parts
