"""Named ranges for the phases of a step (data, transfer, forward, backward, optimizer, checkpoint) at Lightning's
profiler points: ``torch.profiler`` ranges (a labelled Chrome trace, and ops counted per phase) and, on CUDA,
NVTX ranges, so an ``nsys profile -t cuda,nvtx`` timeline is labelled too."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.profilers import Profiler

from lightning_accel._compat import SAVE_CHECKPOINT_ACTION, STRATEGY_ACTION_PREFIX, TRAIN_FETCH_ACTION
from lightning_accel.monitor.ledger import ForwardingProfiler

STRATEGY_PHASES = ((".batch_to_device", "transfer"), (".training_step", "forward"), (".backward", "backward"))
PHASES = ("data", "transfer", "forward", "backward", "optimizer", "checkpoint")


def phase_of(action: str) -> str | None:
    """The phase a Lightning profiler action times, or ``None`` for actions left unlabelled."""
    if action == TRAIN_FETCH_ACTION:
        return "data"
    if action == SAVE_CHECKPOINT_ACTION:
        return "checkpoint"
    if action.startswith(STRATEGY_ACTION_PREFIX):
        for suffix, phase in STRATEGY_PHASES:
            if action.endswith(suffix):
                return phase
    if action.endswith(".optimizer_step") and action.startswith("[LightningModule]"):
        return "optimizer"
    return None


class PhaseRanges(ForwardingProfiler):
    """Forwards every call to ``inner`` and opens a range named after the phase for the labelled actions.

    A ``torch.profiler.record_function`` range always (it costs nothing while no profiler records), an NVTX
    range too when ``nvtx`` (CUDA only).
    """

    def __init__(self, inner: Profiler, nvtx: bool = False) -> None:
        super().__init__(inner)
        self.nvtx = nvtx
        self._open: dict[str, list[Any]] = {}

    def start(self, action_name: str) -> None:
        phase = phase_of(action_name)
        if phase is not None:
            if self.nvtx:
                torch.cuda.nvtx.range_push(phase)
            record = torch.profiler.record_function(phase)
            record.__enter__()
            self._open.setdefault(action_name, []).append(record)
        self.inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)
        open_ranges = self._open.get(action_name)
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)
            if self.nvtx:
                torch.cuda.nvtx.range_pop()
