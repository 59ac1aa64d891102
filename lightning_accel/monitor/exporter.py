"""Prometheus exporter shared by the monitors: one HTTP endpoint per process, every series labelled by run, host
and rank.

Each rank serves its own values on ``port + local_rank`` (one process cannot serve another's), so a scrape
config lists one target per local rank on each node (docs/monitoring.md: N nodes x 8 ranks). Labels: ``run`` (the
run's id, the same on every rank and every attempt: :func:`run_label`), ``host`` and ``rank`` (the global rank), so
a fleet dashboard tells runs apart and picks one run's hosts, and the next run on the same ports is another series.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

__all__ = ["PREFIX", "PrometheusExporter", "resolve_exporter", "run_label", "series_name"]

log = logging.getLogger(__name__)

PREFIX = "lightning_accel_"


def series_name(key: str) -> str:
    """Prometheus name of a metric key: ``goodput/data_share`` -> ``lightning_accel_goodput_data_share``."""
    return PREFIX + key.replace("/", "_").replace(".", "_")


class PrometheusExporter:
    """Serve metrics as Prometheus gauges on ``addr:port + local_rank``.

    Pass one exporter to several monitors (``GoodputMonitor(prometheus=exporter)``,
    ``UtilizationMonitor(prometheus=exporter)``) to publish all of them on one endpoint. The server starts at
    the first publish and stops at :meth:`close`; monitors given a port number instead create and close their
    own. Binds to loopback by default, so nothing is exposed unintentionally.

    ``linger_s``: after the fit, keep serving the final values this many seconds (the process waits for it before
    exiting), so that a scrape every 10-15 s still reads how a short run ended. 0 (the default) stops at once.
    """

    def __init__(
        self, port: int = 9400, addr: str = "127.0.0.1", run: str | None = None, linger_s: float = 0.0
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if not 0 <= linger_s < float("inf"):
            raise ValueError(f"linger_s must be a number of seconds >= 0, got {linger_s}")
        self.port, self.addr, self.linger_s = port, addr, linger_s
        self._lingering: tuple[threading.Timer, Any] | None = None  # a closed fit's timer and server
        self.given_run = run  # the `run` label the user chose; else each fit's run id (follow_run)
        self.run = run or ""
        self.host = socket.gethostname()
        self.bound_port: int | None = None
        self._server: Any = None
        self._registry: Any = None
        self._gauges: dict[str, Any] = {}

    def start(self, local_rank: int = 0) -> None:
        if self._server is not None:
            return
        if self._lingering is not None:  # a new fit in this process: the last one's endpoint makes way
            timer, server = self._lingering
            timer.cancel()
            _stop_server(server)
            self._lingering = None
        self._registry = CollectorRegistry()
        port = self.port + local_rank if self.port else 0
        try:
            self._server, _ = start_http_server(port, addr=self.addr, registry=self._registry)
        except OSError as err:
            raise OSError(
                f"Cannot serve Prometheus metrics on {self.addr}:{port} ({err}); pick a free port "
                "(prometheus=<port>) or stop the program using it"
            ) from err
        self.bound_port = self._server.server_address[1]
        if self.linger_s > 0:  # an exporter nobody closes (made by a recipe) lingers at the process's exit
            atexit.register(self._linger_at_exit)
        log.info("Prometheus metrics on http://%s:%d/metrics", self.addr, self.bound_port)

    def follow_run(self, run: str) -> None:
        """Label what follows with ``run`` (a fit's run id), unless the exporter was given one."""
        if self.given_run is None:
            self.run = run

    def follow_fit(self, trainer: Any) -> None:
        """Label what follows with the fit's run id (:func:`run_label`; every rank calls this at train start, once
        the checkpoint's run id is loaded), unless the exporter was given one."""
        if self.given_run is None:
            self.run = run_label(trainer)

    def publish(self, metrics: Mapping[str, float], rank: int = 0, local_rank: int = 0) -> None:
        """Set one gauge per metric, labelled ``run``, ``host`` and ``rank``; starts the server on first use."""
        self.start(local_rank)

        for key, value in metrics.items():
            name = series_name(key)
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = self._gauges[name] = Gauge(name, key, ["run", "host", "rank"], registry=self._registry)
            gauge.labels(run=self.run, host=self.host, rank=str(rank)).set(float(value))

    @property
    def published(self) -> set[str]:
        """Names of the series published so far."""
        return set(self._gauges)

    def close(self) -> None:
        """Stop serving: now, or after ``linger_s`` seconds (a non-daemon timer: the process lives until then)."""
        atexit.unregister(self._linger_at_exit)
        if self._server is not None and self.linger_s > 0:
            self._say_lingering()
            self._lingering = (threading.Timer(self.linger_s, _stop_server, args=(self._server,)), self._server)
            self._lingering[0].start()
        elif self._server is not None:
            _stop_server(self._server)
        self._server, self.bound_port = None, None
        self._gauges.clear()

    def _say_lingering(self) -> None:
        log.info("Prometheus: serving the final values %g s more on port %s (linger_s)", self.linger_s, self.bound_port)

    def _linger_at_exit(self) -> None:
        if self._server is not None:
            self._say_lingering()
            time.sleep(self.linger_s)
            _stop_server(self._server)
            self._server = None


def _stop_server(server: Any) -> None:
    server.shutdown()
    server.server_close()


def run_label(trainer: Any) -> str:
    """The ``run`` label of a fit, the same on every rank (every rank must call this): the run id a callback keeps
    across attempts (``PreemptionCheckpoint.run_id``); else ``LIGHTNING_ACCEL_RUN_ID`` or torchrun's
    ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``); else rank 0's fresh id for this fit."""
    for callback in trainer.callbacks:
        run_id = getattr(callback, "run_id", None)
        if isinstance(run_id, str) and run_id:
            return run_id
    for name in ("LIGHTNING_ACCEL_RUN_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(name, "")
        if value and value != "none":
            return value
    return str(trainer.strategy.broadcast(uuid.uuid4().hex[:16], src=0))


def resolve_exporter(prometheus: PrometheusExporter | int | None) -> tuple[PrometheusExporter | None, bool]:
    """``(exporter, owned)`` for a monitor's ``prometheus=`` argument: an exporter, a port, or ``None``."""
    if prometheus is None or isinstance(prometheus, PrometheusExporter):
        return prometheus, False
    if isinstance(prometheus, bool) or not isinstance(prometheus, int):
        raise TypeError(f"prometheus must be a PrometheusExporter, a port number or None, got {prometheus!r}")
    return PrometheusExporter(prometheus), True
