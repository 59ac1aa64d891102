"""Throughput callback: samples/s, tokens/s, step time, FLOPs, MFU and the data-wait share."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch.utils.flop_counter import FlopCounterMode

from lightning_accel.monitor.peaks import peak_flops, precision_dtype
from lightning_accel.monitor.summary import print_summary

log = logging.getLogger(__name__)


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in values:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def default_batch_size(batch: Any) -> int:
    """Leading dimension of the first tensor in the batch."""
    tensor = _first_tensor(batch)
    if tensor is None or tensor.ndim == 0:
        raise ValueError("ThroughputCallback cannot infer the batch size; pass batch_size_fn=")
    return int(tensor.shape[0])


def default_tokens(batch: Any) -> int | None:
    """Token count when the first tensor looks like token ids: an integer tensor of shape (batch, seq)."""
    tensor = _first_tensor(batch)
    if tensor is not None and tensor.ndim == 2 and not tensor.is_floating_point() and tensor.dtype != torch.bool:
        return int(tensor.numel())
    return None


@dataclass
class _Step:
    compute_s: float
    wait_s: float
    samples: int
    tokens: int | None


class ThroughputCallback(Callback):
    """Measure and log training throughput to every attached Lightning logger.

    Step time is measured from ``on_train_batch_start`` to ``on_train_batch_end`` (synchronising CUDA);
    the data wait is the gap from the previous batch's end to this batch's start, which covers fetching
    the batch and moving it to the device. FLOPs per batch (forward + backward) are counted once with
    ``torch.utils.flop_counter`` on a real batch, or taken from ``flops_per_batch``.

    Args:
        log_every_n_steps: Logging interval, in training batches.
        window: Number of recent batches the logged rates average over.
        warmup_steps: Batches left out of all statistics (compilation, allocator warm-up).
        batch_size_fn: ``batch -> samples``; default: leading dim of the first tensor.
        tokens_fn: ``batch -> tokens``; default: ``numel`` of the first tensor if it is 2-D integer ids.
        flops_per_batch: FLOPs of one training batch per device; ``None`` counts them on the first batch.
        data_wait_warn: Warn once when the data-wait share exceeds this fraction.
        summary: Print a summary table at the end of fit.
    """

    def __init__(
        self,
        log_every_n_steps: int = 10,
        window: int = 50,
        warmup_steps: int = 2,
        batch_size_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], int | None] | None = None,
        flops_per_batch: float | None = None,
        data_wait_warn: float = 0.10,
        summary: bool = True,
    ) -> None:
        if log_every_n_steps < 1 or window < 1 or warmup_steps < 0:
            raise ValueError("log_every_n_steps and window must be >= 1 and warmup_steps >= 0")
        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = warmup_steps
        self.batch_size_fn = batch_size_fn or default_batch_size
        self.tokens_fn = tokens_fn or default_tokens
        self.flops_per_batch = flops_per_batch
        self.data_wait_warn = data_wait_warn
        self.summary = summary
        self.recent: deque[_Step] = deque(maxlen=window)
        self.history: list[_Step] = []  # all post-warm-up steps: the summary is computed from these
        self.peak: float | None = None
        self.peak_source = "unknown"
        self.results: dict[str, float] = {}
        self._seen = 0
        self._prev_end: float | None = None
        self._start = 0.0
        self._counter: FlopCounterMode | None = None
        self._warned = False

    # -- timing -------------------------------------------------------------------------------------
    @staticmethod
    def _now(pl_module: LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.peak, self.peak_source = peak_flops(pl_module.device, precision_dtype(str(trainer.precision)))

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._prev_end = None  # the gap across an epoch boundary is not data wait

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._prev_end = None  # nor is a validation run inside the epoch

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = self._now(pl_module)
        if self.flops_per_batch is None and self._counter is None:
            # Counted on one real batch: forward, backward and optimizer step of exactly this run.
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        end = self._now(pl_module)
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.flops_per_batch = float(self._counter.get_total_flops())
            self._counter = None
            if not self.flops_per_batch:
                log.warning("No FLOPs were counted (compiled or custom kernels?); pass flops_per_batch= for MFU")
        wait = (self._start - self._prev_end) if self._prev_end is not None else None
        self._prev_end = end
        self._seen += 1
        if self._seen <= self.warmup_steps or wait is None:
            return
        step = _Step(end - self._start, wait, self.batch_size_fn(batch), self.tokens_fn(batch))
        self.recent.append(step)
        self.history.append(step)
        self._maybe_warn()
        if self._seen % self.log_every_n_steps == 0:
            self._log(trainer, self.compute(self.recent, trainer.world_size))

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._counter is not None:  # never leave a dispatch mode active after a crash
            self._counter.__exit__(None, None, None)
            self._counter = None

    # -- metrics ------------------------------------------------------------------------------------
    def compute(self, steps: deque[_Step] | list[_Step], world_size: int = 1) -> dict[str, float]:
        """Rates over ``steps``; per-device rates are multiplied by ``world_size`` for the global ones."""
        if not steps:
            return {}
        compute = sum(s.compute_s for s in steps)
        total = compute + sum(s.wait_s for s in steps)
        samples = sum(s.samples for s in steps)
        metrics = {
            "throughput/samples_per_sec": world_size * samples / total,
            "throughput/step_time_ms": 1000.0 * total / len(steps),
            "throughput/compute_time_ms": 1000.0 * compute / len(steps),
            "throughput/data_wait_share": 1.0 - compute / total,
        }
        if all(s.tokens is not None for s in steps):
            metrics["throughput/tokens_per_sec"] = world_size * sum(s.tokens or 0 for s in steps) / total
        if self.flops_per_batch:
            achieved = self.flops_per_batch * len(steps) / total  # per device
            metrics["throughput/tflops_per_sec_per_device"] = achieved / 1e12
            if self.peak:
                metrics["throughput/mfu"] = achieved / self.peak
        return metrics

    def _maybe_warn(self) -> None:
        # Checked every 10th batch, not every batch: it sums the whole window.
        if self._warned or len(self.recent) < min(5, self.recent.maxlen or 5) or self._seen % 10:
            return
        share = self.compute(self.recent)["throughput/data_wait_share"]
        if share > self.data_wait_warn:
            self._warned = True
            rank_zero_warn(
                f"Input pipeline bound: {share:.0%} of step time is spent waiting for data "
                f"(threshold {self.data_wait_warn:.0%}). Raise num_workers, use pin_memory, or move "
                "augmentation to the GPU (lightning_accel.data.DALIImageDataModule)."
            )

    @rank_zero_only
    def _log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.results = self.compute(self.history, trainer.world_size)
        if self.results:
            self.results["throughput/steps_measured"] = float(len(self.history))
        if self.summary and trainer.is_global_zero and self.results:
            rows: dict[str, object] = {k.split("/", 1)[1]: v for k, v in self.results.items()}
            rows["peak_flops_source"] = self.peak_source
            print_summary("lightning-accel throughput", rows)
