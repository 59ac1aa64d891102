"""GPU (NVML) and host (psutil) telemetry at a wall-clock interval, logged and exported to Prometheus."""

from __future__ import annotations

import logging
import time
from typing import Any

import psutil
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_accel.monitor.exporter import PrometheusExporter, resolve_exporter
from lightning_accel.monitor.summary import print_summary

__all__ = ["GPU_KEYS", "HOST_KEYS", "METRIC_KEYS", "UtilizationMonitor", "nvml_handle"]

log = logging.getLogger(__name__)


def nvml_handle(nvml: Any, cuda_uuid: str, cuda_index: int) -> Any:
    """NVML handle of the GPU that CUDA calls ``cuda_index``.

    NVML numbers GPUs physically, CUDA only those ``CUDA_VISIBLE_DEVICES`` leaves, in its order:
    under SLURM or a per-rank mask, CUDA's device 0 may be NVML's device 3. The UUID names the same
    GPU in both. The index is a last resort (a MIG slice, say), with a warning.
    """
    uuid = cuda_uuid if cuda_uuid.startswith(("GPU-", "MIG-")) else f"GPU-{cuda_uuid}"
    try:
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception as err:
        log.warning(
            "NVML does not know CUDA device %d by UUID %s (%s): reading NVML device %d, which is another GPU "
            "if CUDA_VISIBLE_DEVICES reorders them",
            cuda_index,
            uuid,
            err,
            cuda_index,
        )
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)


class _NVML:
    """Thin guard over nvidia-ml-py: ``available`` is False (with ``reason``) when there is no driver."""

    def __init__(self, device_index: int | None) -> None:
        self.available, self.reason, self.handle = False, "", None
        if not torch.cuda.is_available():
            self.reason = "no CUDA device visible"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device_index if device_index is not None else 0
            self.handle = nvml_handle(pynvml, str(torch.cuda.get_device_properties(index).uuid), index)
            self.pynvml = pynvml
            self.available = True
        except Exception as err:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded ...
            self.reason = f"{type(err).__name__}: {err}"

    def read(self) -> dict[str, float]:
        nv = self.pynvml
        util = nv.nvmlDeviceGetUtilizationRates(self.handle)
        mem = nv.nvmlDeviceGetMemoryInfo(self.handle)
        return {
            "gpu/utilization_pct": float(util.gpu),
            "gpu/memory_used_gib": mem.used / 2**30,
            "gpu/memory_total_gib": mem.total / 2**30,
            "gpu/power_w": nv.nvmlDeviceGetPowerUsage(self.handle) / 1000.0,
            "gpu/temperature_c": float(nv.nvmlDeviceGetTemperature(self.handle, nv.NVML_TEMPERATURE_GPU)),
        }

    def close(self) -> None:
        if self.available:
            self.pynvml.nvmlShutdown()


HOST_KEYS = ("host/cpu_pct", "host/ram_used_gib", "host/ram_total_gib", "host/process_rss_gib")
GPU_KEYS = (
    "gpu/utilization_pct",
    "gpu/memory_used_gib",
    "gpu/memory_total_gib",
    "gpu/power_w",
    "gpu/temperature_c",
)
METRIC_KEYS = HOST_KEYS + GPU_KEYS  # everything this monitor logs and exports (GPU keys only with NVML)


class UtilizationMonitor(Callback):
    """Log device and host utilization every ``every_n_seconds`` of training.

    GPU metrics (utilization, memory used/total, power, temperature) come from NVML when a driver is
    present; without one they are skipped and the reason is logged once. Host metrics (CPU %, RAM,
    process RSS) come from psutil and are always logged. Sampling happens at batch boundaries, so no
    thread competes with training. Every rank samples its own GPU; loggers get rank 0's values, the
    Prometheus exporter every rank's (label ``rank``).

    Args:
        every_n_seconds: Minimum seconds between two samples.
        prometheus: A :class:`~lightning_accel.monitor.PrometheusExporter` (shared with ``GoodputMonitor``) or
            a port number (rank ``r`` serves on ``port + local_rank``); ``None``: no export.
        summary: Print peak values at the end of fit.
    """

    def __init__(
        self,
        every_n_seconds: float = 10.0,
        prometheus: PrometheusExporter | int | None = None,
        summary: bool = True,
    ) -> None:
        if every_n_seconds < 0:
            raise ValueError(f"every_n_seconds must be >= 0, got {every_n_seconds}")
        self.every_n_seconds = every_n_seconds
        self.exporter, self._owns_exporter = resolve_exporter(prometheus)
        self.summary = summary
        self.nvml: _NVML | None = None
        self.last: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self._next_sample = 0.0
        self._process = psutil.Process()

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.nvml is not None:
            return
        # The strategy's device, not the module's: Lightning moves the module only after this hook.
        device = trainer.strategy.root_device
        index = device.index if device.type == "cuda" else None
        self.nvml = _NVML(index)
        if not self.nvml.available:
            log.info("GPU telemetry off (%s); logging host metrics only", self.nvml.reason)
        if self.exporter is not None:
            self.exporter.start(trainer.local_rank)  # a busy port fails here, not mid-run
        psutil.cpu_percent(interval=None)  # first call primes the counter; it always returns 0.0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.exporter is not None:
            self.exporter.follow_fit(trainer)

    def sample(self) -> dict[str, float]:
        """Read all metrics now."""
        vm = psutil.virtual_memory()
        metrics = {
            "host/cpu_pct": psutil.cpu_percent(interval=None),
            "host/ram_used_gib": (vm.total - vm.available) / 2**30,
            "host/ram_total_gib": vm.total / 2**30,
            "host/process_rss_gib": self._process.memory_info().rss / 2**30,
        }
        if self.nvml is not None and self.nvml.available:
            metrics.update(self.nvml.read())
        return metrics

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        if now < self._next_sample:
            return
        self._next_sample = now + self.every_n_seconds
        self.last = self.sample()
        for key, value in self.last.items():
            self.peaks[key] = max(value, self.peaks.get(key, value))
        self._publish(trainer)

    def _publish(self, trainer: Trainer) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.last, step=trainer.global_step)
        if self.exporter is not None:
            self.exporter.publish(self.last, rank=trainer.global_rank, local_rank=trainer.local_rank)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.summary and trainer.is_global_zero and self.peaks:
            print_summary("lightning-accel utilization (peaks)", self.peaks, trainer=trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._owns_exporter and self.exporter is not None:
            self.exporter.close()
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None
