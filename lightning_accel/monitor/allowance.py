"""How long a rank may go without progress before the hang sentinel calls it hung: Trainer-free arithmetic.

Each kind of work (a training batch, a validation batch, a checkpoint save) is timed as it finishes; the allowance
for the phase a rank is in is ``factor`` times its median of the last :data:`WINDOW` (a save: the longest, as saves
vary in size), never below ``floor_s``, and ``startup_s`` while nothing of that kind has been measured (the first
batch compiles and opens the first collectives). A rank that finished training has no allowance left to run out.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["KINDS", "WINDOW", "Allowance"]

WINDOW = 32  # measured durations an allowance is the median (saves: the longest) of
KINDS = ("train", "validation", "save")
_KIND_OF_PHASE = {"validation": "validation", "checkpoint": "save"}  # every other phase is part of a training batch


class Allowance:
    """The sentinel's allowance per phase, from what this rank measured (see the module doc)."""

    def __init__(self, factor: float, floor_s: float, startup_s: float) -> None:
        for name, value in (("factor", factor), ("floor_s", floor_s), ("startup_s", startup_s)):
            if value <= 0:
                raise ValueError(f"HangSentinel: {name} must be > 0, got {value}")
        self.factor, self.floor_s, self.startup_s = factor, floor_s, startup_s
        self.times: dict[str, deque[float]] = {kind: deque(maxlen=WINDOW) for kind in KINDS}

    def record(self, kind: str, seconds: float) -> None:
        """One finished piece of work of ``kind`` (``"train"``, ``"validation"``, ``"save"``) took ``seconds``."""
        self.times[kind].append(seconds)

    def for_phase(self, phase: str) -> float:
        """Seconds the current ``phase`` may go without progress (``"finished"``: no limit)."""
        if phase == "finished":
            return math.inf  # training is over: what follows (an export, a final upload) is not a step to time
        kind = _KIND_OF_PHASE.get(phase, "train")
        times = self.times[kind]
        if not times:
            return float(self.startup_s)
        typical = max(times) if kind == "save" else statistics.median(times)
        return float(max(self.floor_s, self.factor * typical))
