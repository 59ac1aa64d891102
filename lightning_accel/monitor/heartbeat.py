"""Heartbeats and the hang decision, with no Trainer in them (the callback is :mod:`monitor.sentinel`).

Each rank publishes a :class:`Beat` (what it has finished, the phase it is in, how long that phase may take) on a
:class:`Board`: the job's own c10d store under torch.distributed (torchrun's or the strategy's TCPStore; no new
server), a dict in one process. Every rank's watchdog reads all beats and judges them with :func:`find_hang`.
Staleness is measured on the reader's own monotonic clock (when it last saw a rank's progress counter change),
so hosts with skewed wall clocks judge alike.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

# Where a rank is inside one training batch, in order: a rank stuck at an earlier point is the one the others
# wait for (the fast ranks sit in backward's all-reduce while the stuck one is still in its forward or its fetch).
# "finished": the rank's training is over (its last step, or on_train_end): work after it (an export, an upload)
# is never taken for a hang, and a finished rank's last beat is never overdue
PHASE_ORDER = {"data": 0, "forward": 1, "backward": 2, "optimizer": 3, "validation": 4, "checkpoint": 5, "finished": 6}


@dataclass(frozen=True)
class Beat:
    """One rank's latest heartbeat.

    Attributes:
        rank: Global rank.
        host: Host name, so a report says which machine to look at.
        pid: Process id on that host.
        batches: Training batches this rank has finished in this attempt.
        step: The trainer's global step (optimizer steps, the number users know).
        phase: Where the rank is now: a key of :data:`PHASE_ORDER`.
        progress: Counts every batch end and phase change; a rank whose counter stops moving is stalled.
        allowance_s: How long this rank may go without progress in its current phase (from its measured times).
    """

    rank: int
    host: str
    pid: int
    batches: int
    step: int
    phase: str
    progress: int
    allowance_s: float

    def position(self) -> tuple[int, int]:
        return self.batches, PHASE_ORDER.get(self.phase, 0)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Beat:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class HangReport:
    """What the watchdog found: the ranks the others wait for, and every rank's beat and stall."""

    stuck_ranks: list[int]
    beats: list[dict[str, Any]]  # each Beat as a dict, plus "stalled_s"
    detected_by: int
    overdue_ranks: list[int]  # ranks past their allowance when the hang was found
    missing_ranks: list[int]  # ranks that never published a beat

    def describe(self) -> str:
        parts = []
        for beat in self.beats:
            if beat["rank"] in self.stuck_ranks:
                parts.append(
                    f"rank {beat['rank']} (host {beat['host']}, pid {beat['pid']}) in {beat['phase']} after "
                    f"{beat['batches']} finished batches (global step {beat['step']}), no progress for "
                    f"{beat['stalled_s']:.1f} s (allowed {beat['allowance_s']:.1f} s)"
                )
        missing = f"; ranks {self.missing_ranks} never sent a heartbeat" if self.missing_ranks else ""
        return "; ".join(parts) + f" (past their allowance: ranks {self.overdue_ranks})" + missing

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class Board(Protocol):
    """Where beats are published and read, and where the first rank to find a hang posts it."""

    def publish(self, beat: Beat) -> None: ...
    def read(self) -> dict[int, Beat]: ...
    def post_hang(self, report: HangReport) -> None: ...
    def posted_hang(self) -> HangReport | None: ...
    def mark_dumped(self, rank: int) -> None: ...
    def all_dumped(self) -> bool: ...


class LocalBoard:
    """One process: the beats live in this object."""

    def __init__(self) -> None:
        self.beats: dict[int, Beat] = {}
        self.hang: HangReport | None = None

    def publish(self, beat: Beat) -> None:
        self.beats[beat.rank] = beat

    def read(self) -> dict[int, Beat]:
        return dict(self.beats)

    def post_hang(self, report: HangReport) -> None:
        self.hang = report

    def posted_hang(self) -> HangReport | None:
        return self.hang

    def mark_dumped(self, rank: int) -> None:
        pass

    def all_dumped(self) -> bool:
        return True


class StoreBoard:
    """The job's c10d store: one key per rank under ``prefix``, plus the posted hang and who has dumped.

    Reads check for keys before getting them: a ``get`` of a missing key would block for the store's timeout.
    """

    def __init__(self, store: Any, world_size: int, prefix: str) -> None:
        self.store, self.world_size, self.prefix = store, world_size, prefix

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def publish(self, beat: Beat) -> None:
        self.store.set(self._key(f"beat/{beat.rank}"), beat.to_json())

    def read(self) -> dict[int, Beat]:
        keys = [self._key(f"beat/{r}") for r in range(self.world_size)]
        # one round trip once every rank has published (the steady state); key by key only before that
        present = keys if self.store.check(keys) else [k for k in keys if self.store.check([k])]
        if not present:
            return {}
        beats = [Beat.from_json(v) for v in self.store.multi_get(present)]
        return {b.rank: b for b in beats}

    def post_hang(self, report: HangReport) -> None:
        # compare_set: the first report posted is the one every rank acts on
        self.store.compare_set(self._key("hang"), "", report.to_json())

    def posted_hang(self) -> HangReport | None:
        key = self._key("hang")
        if not self.store.check([key]):
            return None
        return HangReport(**json.loads(self.store.get(key)))

    def mark_dumped(self, rank: int) -> None:
        self.store.set(self._key(f"dumped/{rank}"), "1")

    def all_dumped(self) -> bool:
        return self.store.check([self._key(f"dumped/{r}") for r in range(self.world_size)])


class StallClock:
    """When each rank's progress counter last changed, on this reader's monotonic clock."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (progress, when it was first seen)

    def stalled(self, beats: dict[int, Beat]) -> dict[int, float]:
        now = self.clock()
        stalls = {}
        for rank, beat in beats.items():
            progress, since = self._seen.get(rank, (None, now))
            if progress != beat.progress:
                since = now
            self._seen[rank] = (beat.progress, since)
            stalls[rank] = now - since
        return stalls


def find_hang(beats: dict[int, Beat], stalled: dict[int, float], world_size: int, reader: int) -> HangReport | None:
    """A hang when any rank has gone without progress for longer than its allowance.

    The ranks named are those at the earliest position (fewest finished batches, then the earliest phase): the
    others are waiting for them. When all ranks are equally far, all are named.
    """
    overdue = [r for r, b in beats.items() if stalled.get(r, 0.0) > b.allowance_s]
    if not overdue:
        return None
    earliest = min(b.position() for b in beats.values())
    stuck = sorted(r for r, b in beats.items() if b.position() == earliest)
    rows = [{**asdict(beats[r]), "stalled_s": stalled.get(r, 0.0)} for r in sorted(beats)]
    missing = [r for r in range(world_size) if r not in beats]
    return HangReport(
        stuck_ranks=stuck, beats=rows, detected_by=reader, overdue_ranks=sorted(overdue), missing_ranks=missing
    )
