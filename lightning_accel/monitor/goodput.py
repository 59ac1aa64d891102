"""GoodputMonitor: where every second of a fit goes, throughput and MFU, work lost to restarts, stragglers."""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.flop_counter import FlopCounterMode

from lightning_accel.monitor.batches import default_batch_size, default_tokens
from lightning_accel.monitor.exporter import PrometheusExporter, resolve_exporter
from lightning_accel.monitor.ledger import BUCKETS, Ledger, LedgerProfiler, remove_wrapper
from lightning_accel.monitor.peaks import peak_flops, precision_dtype
from lightning_accel.monitor.plot import plot_ledger
from lightning_accel.monitor.progress import read_highest_step, write_highest_step
from lightning_accel.monitor.summary import print_summary

log = logging.getLogger(__name__)

RESULTS_FILE = "goodput.json"

THROUGHPUT_KEYS = (
    "throughput/samples_per_sec",
    "throughput/tokens_per_sec",
    "throughput/batch_time_ms",
    "throughput/step_time_ms",
    "throughput/data_wait_share",
    "throughput/tflops_per_sec_per_device",
    "throughput/mfu",
)
GOODPUT_KEYS = (
    *(f"goodput/{b}_share" for b in BUCKETS),
    *(f"goodput/{b}_s" for b in BUCKETS),
    "goodput/total_s",
    "goodput/lost_steps",
    "goodput/lost_s",
    "goodput/restarts",
    "goodput/straggler_ratio",
    "goodput/slowest_rank",
)
METRIC_KEYS = THROUGHPUT_KEYS + GOODPUT_KEYS  # everything this monitor logs and exports


@dataclass(frozen=True)
class _Mark:
    """Counters at one moment: rates are differences of two marks, so nothing grows with the run."""

    seconds: dict[str, float]
    forward_s: float
    batches: int
    steps: int
    samples: int
    tokens: int | None


class GoodputMonitor(Callback):
    """Account for every second of a fit, and log throughput, MFU, lost work and stragglers.

    The ledger charges wall time to ``data`` (inside the train loader's ``next()``), ``transfer`` (batch to
    device), ``compute`` (training step, backward, optimizer step), ``checkpoint`` (inside every
    ``trainer.save_checkpoint``), ``validation`` (the whole validation loop, sanity check included),
    ``compile`` (first calls compiled by ``TorchCompile``) and ``other`` (loop, callbacks, logging): each
    measured where it happens, at Lightning's own profiler points, so the shares add up to 1. Goodput is the
    compute share.

    Throughput is over training time (wall time less validation), as Lightning's ``ThroughputMonitor``
    counts it: ``batch_time_ms`` per micro-batch, ``step_time_ms`` per optimizer step (they differ under
    ``accumulate_grad_batches``), ``data_wait_share`` the data bucket's share of it.

    Args:
        every_n_steps: Log (and export, and gather the ranks' step times) every this many optimizer steps.
        warmup_steps: Optimizer steps left out of the end-of-fit throughput (the ledger counts them).
        batch_size_fn: ``batch -> samples``; default: leading dimension of the first tensor.
        tokens_fn: ``batch -> tokens``; default: ``numel`` of the first tensor if it holds 2-D integer ids.
        flops_per_batch: FLOPs of one training micro-batch per device; ``None`` counts them on the first one.
        data_wait_warn: Warn once when the data share of training time passes this fraction.
        run_dir: Folder for the progress file and ``goodput.png``; default: the checkpoint callback's folder,
            else the logger's (``trainer.log_dir``); with neither, no files are written.
        progress_every_n_seconds: Record the highest step reached at most this often (a tiny file replaced
            atomically); a restart after a hard kill undercounts the redone work by at most this much.
        prometheus: A :class:`PrometheusExporter` (shared with other monitors) or a port number.
        sync_cuda: Synchronize CUDA at the end of each compute region, so queued kernels are charged to the
            compute that queued them (costs the overlap of that GPU tail with the next fetch).
        summary: Print the breakdown at the end of fit.
        plot: Write ``goodput.png`` (a stacked bar) into ``run_dir`` at the end of fit (``goodput.json``, the
            results, is always written there).
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        warmup_steps: int = 2,
        batch_size_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], int | None] | None = None,
        flops_per_batch: float | None = None,
        data_wait_warn: float = 0.10,
        run_dir: str | Path | None = None,
        progress_every_n_seconds: float = 1.0,
        prometheus: PrometheusExporter | int | None = None,
        sync_cuda: bool = True,
        summary: bool = True,
        plot: bool = True,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.every_n_steps, self.warmup_steps = every_n_steps, warmup_steps
        self.batch_size_fn = batch_size_fn or default_batch_size
        self.tokens_fn = tokens_fn or default_tokens
        self.flops_per_batch = flops_per_batch
        self._counted_flops = flops_per_batch is None
        self.data_wait_warn = data_wait_warn
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if progress_every_n_seconds < 0:
            raise ValueError(f"progress_every_n_seconds must be >= 0, got {progress_every_n_seconds}")
        self.progress_every_n_seconds = progress_every_n_seconds
        self.exporter, self._owns_exporter = resolve_exporter(prometheus)
        self.sync_cuda, self.summary, self.plot = sync_cuda, summary, plot
        self.ledger = Ledger()
        self.results: dict[str, float] = {}
        self.peak: float | None = None
        self.peak_source = "unknown"
        self._reset()

    def _reset(self) -> None:
        self.batches = self.samples = 0
        self.tokens: int | None = 0
        self.restarts = self.lost_steps = 0
        self.lost_s = 0.0
        self.straggler_ratio: float | None = None
        self.slowest_rank: int | None = None
        self._carried = dict.fromkeys(BUCKETS, 0.0)  # seconds of earlier attempts (from the checkpoint)
        self._resumed = False
        self._start_step = self._last_step = self._highest = 0
        self._redo_until: int | None = None
        self._train_start = self._last_progress = 0.0
        self._warm: _Mark | None = None
        self._last_log: _Mark | None = None
        self._warned = False
        self._counter: FlopCounterMode | None = None
        self._wrapper: LedgerProfiler | None = None
        self._val_loop: Any = None
        self._folder: Path | None = None  # run_dir, or where checkpoints or logs go (on_train_start)
        if self._counted_flops:
            self.flops_per_batch = None

    # -- installing the ledger ----------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        self.results = {}
        device = trainer.strategy.root_device
        on_gpu = self.sync_cuda and device.type == "cuda"
        self.ledger.sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else None
        self._wrapper = trainer.profiler = LedgerProfiler(trainer.profiler, self.ledger)
        # The validation loop has no profiler action around all of it (loading, worker start, steps,
        # hooks): its public ``run`` is wrapped for this fit, on this loop instance only.
        loop, ledger = trainer.fit_loop.epoch_loop.val_loop, self.ledger
        original = loop.run

        def run_validation() -> Any:
            ledger.enter("validation")
            try:
                return original()
            finally:
                ledger.exit("validation")

        loop.run = run_validation
        self._val_loop = loop

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._wrapper is not None:
            remove_wrapper(trainer, self._wrapper)
            self._wrapper = None
        if self._val_loop is not None:
            self._val_loop.__dict__.pop("run", None)
            self._val_loop = None
        if self._owns_exporter and self.exporter is not None:
            self.exporter.close()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.ledger.start()
        self.peak, self.peak_source = peak_flops(pl_module.device, precision_dtype(str(trainer.precision)))

    # -- restarts -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "seconds": self._total_seconds(),
            "restarts": self.restarts,
            "lost_steps": self.lost_steps,
            "lost_s": self.lost_s,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._carried = {b: float(state_dict.get("seconds", {}).get(b, 0.0)) for b in BUCKETS}
        self.restarts = int(state_dict.get("restarts", 0))
        self.lost_steps = int(state_dict.get("lost_steps", 0))
        self.lost_s = float(state_dict.get("lost_s", 0.0))
        self._resumed = True

    def _resolve_run_dir(self, trainer: Trainer) -> Path | None:
        if self.run_dir is not None:
            return self.run_dir
        for callback in trainer.callbacks:  # PreemptionCheckpoint, ModelCheckpoint (resolved by now)
            # only checkpoint writers (by the `<What>Checkpoint` convention): a TorchProfiler's dirpath holds traces
            writes_checkpoints = isinstance(callback, Checkpoint) or type(callback).__name__.endswith("Checkpoint")
            dirpath = getattr(callback, "dirpath", None)
            if dirpath is not None and writes_checkpoints:
                return Path(dirpath)
        if trainer.loggers:
            return Path(trainer.log_dir or trainer.default_root_dir)
        return None  # nothing saved and nothing logged: write no files either

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._folder = self._resolve_run_dir(trainer)
        self._start_step = self._last_step = self._highest = trainer.global_step
        self._train_start = self._last_progress = time.perf_counter()
        if self._resumed:
            self.restarts += 1
            reached = read_highest_step(self._folder) if trainer.is_global_zero and self._folder else None
            reached = trainer.strategy.broadcast(reached, src=0)  # every rank reports the same lost work
            if reached is not None and reached > self._start_step:
                self.lost_steps += reached - self._start_step
                self._redo_until = self._highest = reached
                log.info("Resumed at step %d; the previous attempt had reached step %d", self._start_step, reached)
        if trainer.is_global_zero and self._folder is not None:
            write_highest_step(self._folder, self._highest)
        if self.warmup_steps == 0:
            self._warm = self._mark()
        self._last_log = self._mark()

    # -- per batch ----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.flops_per_batch is None and self._counter is None and self.batches == 0:
            # Counted on one real micro-batch: forward, backward and optimizer step of exactly this run.
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def _close_counter(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.flops_per_batch = float(self._counter.get_total_flops())
            self._counter = None
            if not self.flops_per_batch:
                log.warning("No FLOPs were counted (compiled or custom kernels?); pass flops_per_batch= for MFU")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._close_counter()
        self.batches += 1
        self.samples += self.batch_size_fn(batch)
        if self.tokens is not None:
            tokens = self.tokens_fn(batch)
            self.tokens = None if tokens is None else self.tokens + tokens
        step = trainer.global_step
        if step == self._last_step:  # inside an accumulation window
            return
        self._last_step = step
        now = time.perf_counter()
        if self._redo_until is not None and step >= self._redo_until:
            self.lost_s += now - self._train_start
            self._redo_until = None
        if step > self._highest:
            self._highest = step
            due = now - self._last_progress >= self.progress_every_n_seconds
            if due and trainer.is_global_zero and self._folder is not None:
                write_highest_step(self._folder, step)
                self._last_progress = now
        if self._warm is None and step - self._start_step >= self.warmup_steps:
            self._warm = self._mark()
        if step % self.every_n_steps == 0:
            self._on_interval(trainer)

    def _on_interval(self, trainer: Trainer) -> None:
        mark = self._mark()
        assert self._last_log is not None
        metrics = self.rates(self._last_log, mark, trainer.world_size)
        if trainer.world_size > 1:
            self._gather_step_times(trainer, self._last_log, mark)
        self._last_log = mark
        metrics.update(self._goodput())
        share = metrics.get("throughput/data_wait_share", 0.0)
        if not self._warned and share > self.data_wait_warn and mark.steps > self.warmup_steps:
            self._warned = True
            rank_zero_warn(
                f"Input pipeline bound: {share:.0%} of training time is spent inside the train loader's next() "
                f"(threshold {self.data_wait_warn:.0%}). Raise num_workers, use pin_memory, or decode and augment "
                "with DALI (lightning_accel.data.DALIImageDataModule)."
            )
        self._publish(trainer, metrics)

    def _gather_step_times(self, trainer: Trainer, before: _Mark, after: _Mark) -> None:
        # In synchronous data parallelism every rank ends a step together (the fast ones wait inside
        # backward's all-reduce), so wall step times cannot show a straggler. Each rank's time *before* that
        # wait can: its data, transfer and forward per step.
        steps = max(after.steps - before.steps, 1)
        own = sum(after.seconds[b] - before.seconds[b] for b in ("data", "transfer")) + after.forward_s
        own = (own - before.forward_s) / steps
        local = torch.tensor([own], dtype=torch.float64, device=trainer.strategy.root_device)
        times = trainer.strategy.all_gather(local)
        per_rank = [float(t) for t in times.reshape(-1).cpu()]
        median = statistics.median(per_rank)
        self.slowest_rank = max(range(len(per_rank)), key=per_rank.__getitem__)
        self.straggler_ratio = per_rank[self.slowest_rank] / median if median > 0 else 1.0

    # -- metrics ------------------------------------------------------------------------------------
    def _mark(self) -> _Mark:
        return _Mark(
            self.ledger.snapshot(),
            self.ledger.forward_s,
            self.batches,
            self._last_step - self._start_step,
            self.samples,
            self.tokens,
        )

    def rates(self, before: _Mark, after: _Mark, world_size: int = 1) -> dict[str, float]:
        """Throughput between two marks; per-device rates times ``world_size`` for the global ones."""
        seconds = {b: after.seconds[b] - before.seconds[b] for b in BUCKETS}
        train_s = sum(seconds.values()) - seconds["validation"]
        batches, steps = after.batches - before.batches, after.steps - before.steps
        if train_s <= 0 or batches <= 0:
            return {}
        metrics = {
            "throughput/samples_per_sec": world_size * (after.samples - before.samples) / train_s,
            "throughput/batch_time_ms": 1000.0 * train_s / batches,
            "throughput/data_wait_share": seconds["data"] / train_s,
        }
        if steps > 0:
            metrics["throughput/step_time_ms"] = 1000.0 * train_s / steps
        if after.tokens is not None and before.tokens is not None:
            metrics["throughput/tokens_per_sec"] = world_size * (after.tokens - before.tokens) / train_s
        if self.flops_per_batch:
            achieved = self.flops_per_batch * batches / train_s  # per device
            metrics["throughput/tflops_per_sec_per_device"] = achieved / 1e12
            if self.peak:
                metrics["throughput/mfu"] = achieved / self.peak
        return metrics

    def _total_seconds(self) -> dict[str, float]:
        now = self.ledger.snapshot() if self.ledger.running else self.ledger.seconds
        return {b: self._carried[b] + now[b] for b in BUCKETS}

    def _goodput(self) -> dict[str, float]:
        seconds = self._total_seconds()
        total = sum(seconds.values())
        metrics = {f"goodput/{b}_s": s for b, s in seconds.items()}
        metrics.update({f"goodput/{b}_share": (s / total if total > 0 else 0.0) for b, s in seconds.items()})
        metrics["goodput/total_s"] = total
        metrics["goodput/lost_steps"] = float(self.lost_steps)
        metrics["goodput/lost_s"] = self.lost_s
        metrics["goodput/restarts"] = float(self.restarts)
        if self.straggler_ratio is not None and self.slowest_rank is not None:
            metrics["goodput/straggler_ratio"] = self.straggler_ratio
            metrics["goodput/slowest_rank"] = float(self.slowest_rank)
        return metrics

    def _publish(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if self.exporter is not None:
            self.exporter.publish(metrics, rank=trainer.global_rank, local_rank=trainer.local_rank)

    # -- end of fit ---------------------------------------------------------------------------------
    def _finish(self, trainer: Trainer) -> None:
        self._close_counter()
        if self._redo_until is not None:  # stopped again before catching up: all of this attempt was redone
            self.lost_s += time.perf_counter() - self._train_start
            self._redo_until = None
        if trainer.is_global_zero and self._folder is not None:
            write_highest_step(self._folder, self._highest)
        if not self.ledger.running:
            return
        end = self._mark()
        start = self._warm or _Mark(dict.fromkeys(BUCKETS, 0.0), 0.0, 0, 0, 0, 0 if self.tokens is not None else None)
        if start.batches == end.batches:  # shorter than the warm-up: use all of it
            start = _Mark(dict.fromkeys(BUCKETS, 0.0), 0.0, 0, 0, 0, 0 if self.tokens is not None else None)
        self.results = self.rates(start, end, trainer.world_size)
        self.results["throughput/batches_measured"] = float(end.batches - start.batches)
        self.results["throughput/steps_measured"] = float(end.steps - start.steps)
        self.results.update(self._goodput())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer)
        self._publish(trainer, self.results)  # before Lightning tears the loggers down

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.ledger.stop()
        if not trainer.is_global_zero or not self.results:
            return
        if self._folder is not None:  # for `lightning-accel doctor`
            self._folder.mkdir(parents=True, exist_ok=True)
            run = {"precision": str(trainer.precision), "device": str(trainer.strategy.root_device)}
            (self._folder / RESULTS_FILE).write_text(json.dumps({**self.results, **run}, indent=1))
        if self.summary:
            self._print_summary()
        if self.plot and self._folder is not None:
            bars = {"this attempt": {b: self.results[f"goodput/{b}_s"] - self._carried[b] for b in BUCKETS}}
            if self.restarts:
                bars["whole run"] = {b: self.results[f"goodput/{b}_s"] for b in BUCKETS}
            path = plot_ledger(bars, self._folder / "goodput.png", title="lightning-accel goodput ledger")
            log.info("goodput ledger plot: %s", path)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._finish(trainer)  # Preempted included: results and the progress file hold up to the stop
        self.ledger.stop()

    def _print_summary(self) -> None:
        rows: dict[str, object] = {}
        for bucket in BUCKETS:
            seconds, share = self.results[f"goodput/{bucket}_s"], self.results[f"goodput/{bucket}_share"]
            rows[bucket] = f"{seconds:.2f} s  {share:6.1%}"
        rows["goodput (compute share)"] = f"{self.results['goodput/compute_share']:.1%}"
        for key in THROUGHPUT_KEYS:
            if key in self.results:
                rows[key.split("/", 1)[1]] = self.results[key]
        if self.restarts:
            rows["restarts"] = self.restarts
            rows["lost steps / seconds"] = f"{self.lost_steps} / {self.lost_s:.1f} s"
        if self.straggler_ratio is not None:
            rows["straggler ratio (slowest rank)"] = f"{self.straggler_ratio:.2f} (rank {self.slowest_rank})"
        rows["peak_flops_source"] = self.peak_source
        print_summary("lightning-accel goodput", rows)
