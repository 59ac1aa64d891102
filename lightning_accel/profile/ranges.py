"""Named ranges for the phases of a step (data, transfer, forward, backward, optimizer, checkpoint) at Lightning's
profiler points: ``torch.profiler`` ranges (a labelled Chrome trace, and ops counted per phase) and, on CUDA,
NVTX ranges, so an ``nsys profile -t cuda,nvtx`` timeline is labelled too."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.profilers import Profiler
from typing_extensions import override

from lightning_accel.monitor.forwarding import ForwardingProfiler
from lightning_accel.phases import phase_of

__all__ = ["PHASES", "PhaseRanges"]

# The phases of the shared table (lightning_accel.phases) that get a named range: the parts of a step, and saves.
PHASES = ("data", "transfer", "forward", "backward", "optimizer", "checkpoint")


class PhaseRanges(ForwardingProfiler):
    """Forwards every call to ``inner`` and opens a range named after the phase for the labelled actions.

    A ``torch.profiler.record_function`` range always (it costs nothing while no profiler records), an NVTX
    range too when ``nvtx`` (CUDA only).
    """

    def __init__(self, inner: Profiler, nvtx: bool = False) -> None:
        super().__init__(inner)
        self.nvtx = nvtx
        self._open: dict[str, list[Any]] = {}

    @override
    def start(self, action_name: str) -> None:
        phase = phase_of(action_name)
        if phase in PHASES:
            if self.nvtx:
                torch.cuda.nvtx.range_push(phase)
            record = torch.profiler.record_function(phase)
            record.__enter__()
            self._open.setdefault(action_name, []).append(record)
        self.inner.start(action_name)

    @override
    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)
        open_ranges = self._open.get(action_name)
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)
            if self.nvtx:
                torch.cuda.nvtx.range_pop()
