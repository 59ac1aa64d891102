"""GoodputMonitor: where every second of a fit goes, throughput and MFU, work lost to restarts, stragglers.

The arithmetic is :class:`~lightning_accel.monitor.accounting.GoodputAccounting` (no Trainer in it); this callback feeds
it from Lightning's hooks, installs the ledger's profiler for the fit, and writes, logs and exports the figures."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from lightning_accel._compat import wrap_validation_runs
from lightning_accel.checkpoint.resumed_run import nothing_left_to_train
from lightning_accel.monitor.accounting import (
    INPUT_BOUND_SHARE,
    METRIC_KEYS,
    GoodputAccounting,
    Mark,
    input_bound_warning,
)
from lightning_accel.monitor.batches import default_batch_size, default_tokens
from lightning_accel.monitor.cost import Pricing, cost_figures
from lightning_accel.monitor.exporter import PrometheusExporter, resolve_exporter
from lightning_accel.monitor.forwarding import remove_wrapper
from lightning_accel.monitor.ledger import Ledger, LedgerProfiler
from lightning_accel.monitor.membership import MembershipLog
from lightning_accel.monitor.peaks import peak_flops, precision_dtype
from lightning_accel.monitor.plot import ledger_bars, plot_ledger
from lightning_accel.monitor.progress import last_progress_time, read_highest_step, steps_left, write_highest_step
from lightning_accel.monitor.run_folder import chosen_run_folder, remote_data_source
from lightning_accel.monitor.summary import goodput_rows, print_summary
from lightning_accel.ranks import gather_from_ranks

log = logging.getLogger(__name__)

RESULTS_FILE = "goodput.json"
__all__ = ["METRIC_KEYS", "RESULTS_FILE", "GoodputMonitor"]


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
        data_wait_warn: Warn once, at the end of training, when the run waited for the train loader more than this
            share of its time (the doctor's input threshold: they agree).
        run_dir: Folder for the progress file and ``goodput.png``; default: the run's one folder
            (``monitor/run_folder.py``: the checkpoint callback's folder, for a bucket its staging folder, else the
            logger's ``trainer.log_dir``); with neither, no files are written.
        progress_every_n_seconds: Record the highest step reached at most this often (a tiny file replaced
            atomically); a restart after a hard kill undercounts the redone work by at most this much.
        prometheus: A :class:`PrometheusExporter` (shared with other monitors) or a port number.
        sync_cuda: Synchronize CUDA at the end of each compute region, so queued kernels are charged to the
            compute that queued them (costs the overlap of that GPU tail with the next fetch).
        summary: Print the breakdown at the end of fit.
        plot: Write ``goodput.png`` (a stacked bar) into ``run_dir`` at the end of fit (``goodput.json``, the
            results, is always written there).
        pricing: What the machines cost (:class:`~lightning_accel.monitor.cost.Pricing`): every bucket gets
            dollars beside its seconds, plus lost dollars, cost per million samples and cost to finish
            (docs/cost.md). Default: from ``LIGHTNING_ACCEL_PRICE_*`` environment variables, else no cost figures.
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        warmup_steps: int = 2,
        batch_size_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], int | None] | None = None,
        flops_per_batch: float | None = None,
        data_wait_warn: float = INPUT_BOUND_SHARE,
        run_dir: str | Path | None = None,
        progress_every_n_seconds: float = 1.0,
        prometheus: PrometheusExporter | int | None = None,
        sync_cuda: bool = True,
        summary: bool = True,
        plot: bool = True,
        pricing: Pricing | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.every_n_steps, self.warmup_steps = every_n_steps, warmup_steps
        self.batch_size_fn = batch_size_fn or default_batch_size
        self.tokens_fn = tokens_fn or default_tokens
        self._counted_flops = flops_per_batch is None
        self.data_wait_warn = data_wait_warn
        self.run_dir = Path(run_dir) if run_dir is not None else None  # given; the resolved one is _run_dir
        if progress_every_n_seconds < 0:
            raise ValueError(f"progress_every_n_seconds must be >= 0, got {progress_every_n_seconds}")
        self.progress_every_n_seconds = progress_every_n_seconds
        self.exporter, self._owns_exporter = resolve_exporter(prometheus)
        self.sync_cuda, self.summary, self.plot = sync_cuda, summary, plot
        self.accounting = GoodputAccounting(flops_per_batch)
        self.membership = MembershipLog()  # changes of world size and what each cost, carried across attempts
        self.pricing = pricing if pricing is not None else Pricing.from_env()
        self.results: dict[str, float] = {}
        self.peak_source = "unknown"
        self._reset()

    def _reset(self) -> None:
        self.accounting.reset()
        self.membership.load_state_dict(None)
        self._world_size, self._saved_world, self._saved_at = 1, None, None  # now; and the checkpoint's, if any
        self._highest = 0
        self._last_progress = 0.0
        self._warm: Mark | None = None
        self._last_log: Mark | None = None
        self._counter: FlopCounterMode | None = None
        self._wrapper: LedgerProfiler | None = None
        self._undo_validation_timing: Callable[[], None] | None = None
        self._run_dir: Path | None = None  # run_dir, or where checkpoints or logs go (on_train_start)
        self._hosts: list[str] = []  # every rank's host name (on_train_start)
        self._warned_straggler: int | None = None
        self._finished_before = False  # this fit resumed a finished run's last checkpoint: nothing is accounted
        if self._counted_flops:
            self.accounting.flops_per_batch = None

    @property
    def flops_per_batch(self) -> float | None:
        """FLOPs of one training micro-batch per device: given, or counted on the first one."""
        return self.accounting.flops_per_batch

    @property
    def ledger(self) -> Ledger:
        return self.accounting.ledger

    # -- installing the ledger ----------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        self.results = {}
        device = trainer.strategy.root_device
        on_gpu = self.sync_cuda and device.type == "cuda"
        self.ledger.sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else None
        self._wrapper = trainer.profiler = LedgerProfiler(trainer.profiler, self.ledger)
        ledger = self.ledger
        self._undo_validation_timing = wrap_validation_runs(
            trainer, lambda: ledger.enter("validation"), lambda: ledger.exit("validation")
        )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._wrapper is not None:
            remove_wrapper(trainer, self._wrapper)
            self._wrapper = None
        if self._undo_validation_timing is not None:
            self._undo_validation_timing()
            self._undo_validation_timing = None
        if self._owns_exporter and self.exporter is not None:
            self.exporter.close()

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.ledger.start()
        self.accounting.peak_flops, self.peak_source = peak_flops(
            pl_module.device, precision_dtype(str(trainer.precision))
        )

    # -- restarts -----------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        state = {"membership": self.membership.state_dict(), "world_size": self._world_size, "saved_at": time.time()}
        return {**self.accounting.state_dict(), **state}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.accounting.load_state_dict(state_dict)
        self.membership.load_state_dict(state_dict.get("membership"))
        self._saved_world, self._saved_at = state_dict.get("world_size"), state_dict.get("saved_at")

    def _record_membership_change(self, trainer: Trainer) -> None:
        # every rank calls this (a broadcast): the group resumed a checkpoint written by another number of ranks
        last = last_progress_time(self._run_dir) if trainer.is_global_zero and self._run_dir else None
        last = trainer.strategy.broadcast(last, src=0)
        before, now = self._saved_world, trainer.world_size
        change = self.membership.begin(before, now, trainer.global_step, self._saved_at, last, time.time())
        if trainer.is_global_zero:
            log.warning("membership change: %s so far (the replay is counted as it happens)", change.describe())

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.accounting.resumed and nothing_left_to_train(trainer):
            self._finished_before = True  # the same command again after the run finished: no attempt, no restart
            return
        if self.exporter is not None:
            self.exporter.follow_fit(trainer)
        self._run_dir = chosen_run_folder(trainer)  # None: nothing saved and nothing logged, no files
        self._hosts = gather_from_ranks(socket.gethostname())
        start = trainer.global_step
        reached = None
        if self.accounting.resumed:
            reached = read_highest_step(self._run_dir) if trainer.is_global_zero and self._run_dir else None
            reached = trainer.strategy.broadcast(reached, src=0)  # every rank reports the same lost work
        if self.accounting.begin_attempt(start, reached):
            log.info("Resumed at step %d; the previous attempt had reached step %d", start, reached)
        self._world_size = trainer.world_size
        if self._saved_world not in (None, trainer.world_size) and self._saved_at is not None:
            self._record_membership_change(trainer)
        self._highest = max(start, reached or 0)
        self._last_progress = time.perf_counter()
        if trainer.is_global_zero and self._run_dir is not None:
            write_highest_step(self._run_dir, self._highest)
        if self.warmup_steps == 0:
            self._warm = self.accounting.mark()
        self._last_log = self.accounting.mark()

    # -- per batch ----------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if (
            self._counted_flops
            and self.flops_per_batch is None
            and self._counter is None
            and not self.accounting.batches
        ):
            # Counted on one real micro-batch: forward, backward and optimizer step of exactly this run.
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def _close_counter(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.accounting.flops_per_batch = float(self._counter.get_total_flops())
            self._counter = None
            if not self.flops_per_batch:
                log.warning("No FLOPs were counted (compiled or custom kernels?); pass flops_per_batch= for MFU")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._close_counter()
        previous = self.accounting.step
        tokens = self.tokens_fn(batch) if self.accounting.tokens is not None else None
        step = trainer.global_step
        self.accounting.update(self.batch_size_fn(batch), tokens, step)
        if step == previous:  # inside an accumulation window
            return
        # caught up with the previous attempt: the replay is what a membership change cost too
        self.membership.replayed(self.accounting.reached(step))
        if step > self._highest:
            self._highest = step
            now = time.perf_counter()
            due = now - self._last_progress >= self.progress_every_n_seconds
            if due and trainer.is_global_zero and self._run_dir is not None:
                write_highest_step(self._run_dir, step)
                self._last_progress = now
        if self._warm is None and step - self.accounting.start_step >= self.warmup_steps:
            self._warm = self.accounting.mark()
        if step % self.every_n_steps == 0:
            self._on_interval(trainer)

    def _on_interval(self, trainer: Trainer) -> None:
        mark = self.accounting.mark()
        assert self._last_log is not None
        metrics = self.accounting.rates(self._last_log, mark, trainer.world_size)
        if trainer.world_size > 1:
            own = self.accounting.own_step_time(self._last_log, mark)
            local = torch.tensor([own], dtype=torch.float64, device=trainer.strategy.root_device)
            self.accounting.set_rank_step_times(
                [float(t) for t in trainer.strategy.all_gather(local).reshape(-1).cpu()]
            )
            metrics["goodput/presync_step_s"] = self.accounting.rank_step_s[trainer.global_rank]
            self._warn_straggler(trainer)
        self._last_log = mark
        metrics.update(self.accounting.goodput())
        metrics.update(self.membership.metrics())
        metrics.update(self._costs(trainer, metrics))
        self._publish(trainer, metrics)

    def _costs(self, trainer: Trainer, goodput: dict[str, float]) -> dict[str, float]:
        """The cost figures for ``goodput`` (empty without a price)."""
        if self.pricing is None:
            return {}
        acc = self.accounting
        steps = acc.step - acc.start_step
        attempt_s = goodput["goodput/total_s"] - sum(acc.carried.values())  # this attempt's, as `goodput` has it
        tokens = acc.run_tokens()
        return cost_figures(
            goodput,
            self.pricing,
            world_size=trainer.world_size,
            num_nodes=trainer.num_nodes,
            samples=acc.run_samples() * trainer.world_size,  # every rank trains as many samples
            tokens=tokens * trainer.world_size if tokens is not None else None,
            seconds_per_step=attempt_s / steps if steps > 0 else None,
            steps_left=steps_left(trainer),
        )

    def _warn_straggler(self, trainer: Trainer) -> None:
        rank = self.accounting.straggler_rank
        if rank is None or rank == self._warned_straggler or not trainer.is_global_zero:
            return
        self._warned_straggler = rank
        times = self.accounting.rank_step_s
        others = sorted(t for r, t in enumerate(times) if r != rank)
        log.warning(
            "Straggler: rank %d (host %s) spends %.2fx the other ranks' median time per step before the gradient "
            "sync (%.1f ms vs %.1f ms, medians over the last %d logging intervals); every other rank waits for it. "
            "Check that host's load, its data path and its input shard (`lightning-accel doctor` repeats this).",
            rank,
            self._hosts[rank] if rank < len(self._hosts) else "?",
            self.accounting.straggler_ratio,
            1000 * times[rank],
            1000 * others[len(others) // 2],
            self.accounting.straggler_intervals,
        )

    def _publish(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if self.exporter is not None:
            self.exporter.publish(metrics, rank=trainer.global_rank, local_rank=trainer.local_rank)

    # -- end of fit ---------------------------------------------------------------------------------
    def _finish(self, trainer: Trainer) -> None:
        self._close_counter()
        self.membership.replayed(self.accounting.end_attempt())
        if trainer.is_global_zero and self._run_dir is not None:
            write_highest_step(self._run_dir, self._highest)
        if self.ledger.running:
            self.results = self.accounting.compute(self._warm, trainer.world_size)
            self.results.update(self.membership.metrics())
            self.results.update(self._costs(trainer, self.results))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._finished_before:  # goodput.json and the loggers keep the finished run's values
            return
        self._finish(trainer)
        self._publish(trainer, self.results)  # before Lightning tears the loggers down
        if (warning := input_bound_warning(self.results, self.data_wait_warn)) is not None:
            rank_zero_warn(warning)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.ledger.stop()
        self._report(trainer)

    def _report(self, trainer: Trainer) -> None:
        """Rank 0: ``goodput.json`` for the doctor, the summary table and the PNG (a fit's end, or an attempt's)."""
        if not trainer.is_global_zero or not self.results:
            return
        if self._run_dir is not None:  # for `lightning-accel doctor`
            self._run_dir.mkdir(parents=True, exist_ok=True)
            run = {"precision": str(trainer.precision), "device": str(trainer.strategy.root_device)}
            if (source := remote_data_source(trainer)) is not None:  # the doctor's fix for slow remote reads
                run["data_source"] = source
            if self.accounting.straggler_rank is not None:
                run["straggler_host"] = self._hosts[self.accounting.straggler_rank]
            if self.membership.changes:  # each change with its parts, for people and benchmarks
                run["membership"] = self.membership.state_dict()
            (self._run_dir / RESULTS_FILE).write_text(json.dumps({**self.results, **run}, indent=1))
        if self.summary:
            rows = goodput_rows(self.results, self.accounting, self.pricing, self.membership.changes)
            print_summary("lightning-accel goodput", {**rows, "peak_flops_source": self.peak_source}, trainer=trainer)
        if self.plot and self._run_dir is not None:
            bars = ledger_bars(self.results, self.accounting.carried, whole_run=bool(self.accounting.restarts))
            path = plot_ledger(bars, self._run_dir / "goodput.png", title="lightning-accel goodput ledger")
            log.info("goodput ledger plot: %s", path)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._finish(trainer)  # Preempted included: results and the progress file hold up to the stop
        self.ledger.stop()
        try:  # a preempted (or failed) attempt reports too: the doctor reads it; never masking the exception
            self._report(trainer)
        except Exception as err:
            log.warning("no goodput report for this attempt: %s: %s", type(err).__name__, err)
