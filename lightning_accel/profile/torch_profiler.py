"""TorchProfiler: ``torch.profiler`` over a window of training steps, a trace Perfetto and TensorBoard open, and
the aggregates the doctor reads (``profile_summary.json``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
from typing_extensions import override

from lightning_accel.monitor.forwarding import remove_wrapper
from lightning_accel.monitor.run_folder import run_folder
from lightning_accel.phases import PROFILER_ACTION
from lightning_accel.profile.ranges import PHASES, PhaseRanges

__all__ = ["HOST_READS", "PAGEABLE_COPY", "SUMMARY_FILE", "SYNC_OPS", "TorchProfiler", "counts_per_phase", "summarize"]

log = logging.getLogger(__name__)

SUMMARY_FILE = "profile_summary.json"
# CUDA runtime calls where the host waits for the device. (``aten::item`` alone is no sync: optimizers call
# it on CPU step counters; on a CUDA tensor it shows up as one of these.)
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
PAGEABLE_COPY = "Memcpy HtoD (Pageable -> Device)"


HOST_READS = ("aten::item", "aten::tolist")  # a tensor read back by the host: a sync when the tensor is on a GPU


def counts_per_phase(prof: profile) -> tuple[dict[str, int], dict[str, int]]:
    """``(aten ops, host reads)`` under each phase range; ``outside`` for those under none.

    Each event is charged to its nearest phase: ``forward`` is the user's ``training_step``, so an optimizer's
    own ``.item()`` on its CPU step counter is not the model's, and a dataset's indexing ops are ``data``.
    """
    ops: dict[str, int] = {}
    reads: dict[str, int] = {}
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name not in PHASES:
            parent = parent.cpu_parent
        phase = parent.name if parent is not None else "outside"
        ops[phase] = ops.get(phase, 0) + 1
        if event.name in HOST_READS:
            reads[phase] = reads.get(phase, 0) + 1
    return ops, reads


def summarize(prof: profile, steps: int, device: torch.device) -> dict[str, Any]:
    """What the doctor needs from one profiling window, from torch.profiler's own aggregates."""
    averages = prof.key_averages()
    ops = [
        {
            "name": e.key,
            "count": int(e.count),
            "self_cpu_s": e.self_cpu_time_total / 1e6,
            "self_device_s": getattr(e, "self_device_time_total", 0.0) / 1e6,
        }
        for e in averages
    ]
    by_name = {op["name"]: op for op in ops}
    steps = max(steps, 1)
    ops_in, reads_in = counts_per_phase(prof)
    aten = [op for op in ops if op["name"].startswith("aten::")]
    kernels_s = sum(op["self_device_s"] for op in ops if not op["name"].startswith(("aten::", "cuda", "Memcpy")))
    step_events = [e for e in averages if e.key.startswith("ProfilerStep")]  # "ProfilerStep*" once averaged
    window_s = sum(e.cpu_time_total for e in step_events) / 1e6 if step_events else 0.0
    summary: dict[str, Any] = {
        "device": device.type,
        "steps": steps,
        "window_s": window_s,
        "step_s": window_s / steps if window_s else None,
        "aten_ops_per_step": sum(op["count"] for op in aten) / steps,
        "sync_calls_per_step": {name: by_name[name]["count"] / steps for name in SYNC_OPS if name in by_name},
        "item_calls_per_step": by_name.get("aten::item", {}).get("count", 0) / steps,
        "aten_ops_per_step_by_phase": {phase: n / steps for phase, n in ops_in.items()},
        "host_reads_per_step": {phase: n / steps for phase, n in reads_in.items()},
        "pageable_copies_per_step": by_name.get(PAGEABLE_COPY, {}).get("count", 0) / steps,
        "pageable_copy_s_per_step": by_name.get(PAGEABLE_COPY, {}).get("self_device_s", 0.0) / steps,
        "device_busy_s_per_step": kernels_s / steps,
        "top_ops": sorted(
            (op for op in ops if not op["name"].startswith("ProfilerStep")),  # the step itself, not an op
            key=lambda op: -(op["self_device_s"] or op["self_cpu_s"]),
        )[:15],
    }
    if device.type == "cuda":
        summary["memory_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        summary["memory_total_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return summary


class TorchProfiler(Callback):
    """Profile a window of training steps with ``torch.profiler`` and write what is needed to act on it.

    The window follows torch's schedule: ``wait`` steps skipped, ``warmup`` steps traced and dropped (the
    profiler's own start-up), then ``active`` steps recorded. Into ``dirpath`` go a Chrome trace per rank
    (``*.pt.trace.json.gz``: open it in Perfetto, or point TensorBoard's profile plugin at the folder) and
    ``profile_summary.json`` (ops per step, host reads per phase, sync points, pageable copies, device busy
    time, top ops), which ``lightning-accel doctor`` reads. Ranges name the phases of each step (data,
    transfer, forward, backward, optimizer, checkpoint) in the trace and, on CUDA, as NVTX ranges, so
    ``nsys profile -t cuda,nvtx`` timelines are labelled.

    Args:
        wait, warmup, active: The schedule, in training batches (micro-batches under accumulation).
        record_shapes, profile_memory, with_stack: Passed to ``torch.profiler.profile``.
        nvtx: NVTX ranges on CUDA (no effect elsewhere).
        dirpath: Output folder; default: ``profile/`` in the run's one folder (``monitor/run_folder.py``: a
            ``GoodputMonitor``'s ``run_dir``, else the checkpoint folder, the log dir, the root dir), where
            ``lightning-accel doctor`` looks.
    """

    def __init__(
        self,
        wait: int = 5,
        warmup: int = 2,
        active: int = 5,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        nvtx: bool = True,
        dirpath: str | Path | None = None,
    ) -> None:
        for name, value in (("wait", wait), ("warmup", warmup)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if active < 1:
            raise ValueError(f"active must be >= 1, got {active}")
        self.wait, self.warmup, self.active = wait, warmup, active
        self.options = {"record_shapes": record_shapes, "profile_memory": profile_memory, "with_stack": with_stack}
        self.nvtx = nvtx
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.summary: dict[str, Any] = {}
        self._prof: profile | None = None
        self._batches = 0
        self._ranges: PhaseRanges | None = None

    @property
    def window(self) -> int:
        return self.wait + self.warmup + self.active

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.dirpath is None:  # profile/ in the run's one folder (monitor/run_folder.py)
            self.dirpath = run_folder(trainer) / "profile"
        self.summary, self._batches = {}, 0
        nvtx = self.nvtx and trainer.strategy.root_device.type == "cuda"
        self._ranges = trainer.profiler = PhaseRanges(trainer.profiler, nvtx=nvtx)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = trainer.strategy.root_device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        assert self.dirpath is not None
        trace = tensorboard_trace_handler(str(self.dirpath), worker_name=f"rank{trainer.global_rank}", use_gzip=True)

        def ready(prof: profile) -> None:
            # Aggregates first, then the export (exporting twice crashes the profiler on torch 2.13; this order is
            # right on every version, so it needs no version gate)
            self.summary = summarize(prof, self.active, device)
            trace(prof)
            if trainer.is_global_zero:
                (self.dirpath / SUMMARY_FILE).write_text(json.dumps(self.summary, indent=1))  # type: ignore[operator]
            log.info("profile of %d steps written to %s", self.active, self.dirpath)

        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=ready,
            **self.options,
        )
        self._prof.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._prof is None:
            return
        self._batches += 1
        # The profiler's own work (starting, exporting the trace) is not the run's: the ledger leaves it out.
        trainer.profiler.start(PROFILER_ACTION)
        try:
            self._prof.step()
            if self._batches >= self.window:
                self._stop()
        finally:
            trainer.profiler.stop(PROFILER_ACTION)

    def _stop(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._prof is not None and self._batches < self.window:
            log.warning(
                "TorchProfiler: training ended after %d batches, before the window of %d (wait %d, warmup %d, "
                "active %d) closed: no trace; lower wait/active or train longer",
                self._batches,
                self.window,
                self.wait,
                self.warmup,
                self.active,
            )
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._ranges is not None:
            remove_wrapper(trainer, self._ranges)
            self._ranges = None
