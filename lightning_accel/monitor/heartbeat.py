"""Heartbeats and the hang decision, with no Trainer in them (the callback is :mod:`monitor.sentinel`).

Each rank publishes a :class:`Beat` (what it has finished, the phase it is in, how long that phase may take) on a
:class:`Board`: the job's own c10d store under torch.distributed (torchrun's or the strategy's TCPStore; no new
server), a dict in one process. One rank judges (:class:`Watch`): it reads every beat, judges them with
:func:`find_hang` and posts a :class:`Verdict`; every other rank only publishes its beat and reads the verdict. So
the store serves O(W) keys a poll in all, not W^2. Staleness is measured on the judge's own monotonic clock (when
it last saw a rank's progress counter change), so hosts with skewed wall clocks judge alike.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

__all__ = [
    "PHASE_ORDER",
    "Beat",
    "Board",
    "HangReport",
    "LocalBoard",
    "StallClock",
    "StoreBoard",
    "Verdict",
    "Watch",
    "find_hang",
]

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Verdict:
    """What the judging rank posts each poll: who judges, a tick that shows it is alive, and the hang once found."""

    judge: int
    tick: int
    hang: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Verdict:
        return cls(**json.loads(text))


class Board(Protocol):
    """Where beats are published and read, where the judging rank posts its verdict, and who has dumped."""

    def publish(self, beat: Beat) -> None: ...
    def read(self) -> dict[int, Beat]: ...
    def read_verdict(self) -> str | None: ...
    def swap_verdict(self, expected: str, desired: str) -> str: ...
    def mark_dumped(self, rank: int) -> None: ...
    def all_dumped(self) -> bool: ...
    def leave(self) -> None: ...  # this rank has published its last beat (a board on disk tidies up after the last)


class LocalBoard:
    """One process (or a test's simulated ranks): the beats and the verdict live in this object."""

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self.beats: dict[int, Beat] = {}
        self.verdict: str | None = None
        self.dumped: set[int] = set()

    def publish(self, beat: Beat) -> None:
        self.beats[beat.rank] = beat

    def read(self) -> dict[int, Beat]:
        return dict(self.beats)

    def read_verdict(self) -> str | None:
        return self.verdict

    def swap_verdict(self, expected: str, desired: str) -> str:
        if (self.verdict or "") == expected:
            self.verdict = desired
        return self.verdict or ""

    def mark_dumped(self, rank: int) -> None:
        self.dumped.add(rank)

    def all_dumped(self) -> bool:
        return len(self.dumped) >= self.world_size

    def leave(self) -> None:
        pass  # nothing outside this object


class StoreBoard:
    """The job's c10d store: one key per rank's beat under ``prefix``, the verdict, and a count of ranks dumped.

    Every operation is O(1) store work except :meth:`read` (O(W) keys in one round trip), which only the judging
    rank calls. A ``get`` of a missing key would block for the store's timeout: keys are checked until they exist.
    """

    def __init__(self, store: Any, world_size: int, prefix: str) -> None:
        self.store, self.world_size, self.prefix = store, world_size, prefix
        self._verdict_exists = False  # never deleted once posted: checked until then, read directly after

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def put(self, name: str, value: str) -> None:
        """Set key ``name`` under the prefix (a one-way write)."""
        self.store.set(self._key(name), value)

    def values(self, names: list[str]) -> list[bytes]:
        """The values of the keys ``names`` (under the prefix) that exist, in order: one round trip once all of
        them exist (the steady state), key by key only before that."""
        keys = [self._key(name) for name in names]
        present = keys if self.store.check(keys) else [k for k in keys if self.store.check([k])]
        return self.store.multi_get(present) if present else []

    def publish(self, beat: Beat) -> None:
        self.put(f"beat/{beat.rank}", beat.to_json())

    def read(self) -> dict[int, Beat]:
        beats = [Beat.from_json(v) for v in self.values([f"beat/{r}" for r in range(self.world_size)])]
        return {b.rank: b for b in beats}

    def read_verdict(self) -> str | None:
        key = self._key("verdict")
        if not self._verdict_exists and not self.store.check([key]):
            return None
        self._verdict_exists = True
        return self.store.get(key).decode()

    def swap_verdict(self, expected: str, desired: str) -> str:
        # compare_set: the verdict changes only from what this judge last saw, so two judges never both win
        current = self.store.compare_set(self._key("verdict"), expected, desired)
        return current.decode() if isinstance(current, bytes) else str(current)

    def mark_dumped(self, rank: int) -> None:
        self.store.add(self._key("dumped"), 1)

    def all_dumped(self) -> bool:
        return self.store.add(self._key("dumped"), 0) >= self.world_size

    def leave(self) -> None:
        pass  # the keys end with the job's store


class StallClock:
    """When each rank's progress counter last changed, on this reader's monotonic clock."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (progress, when it was first seen)
        self._silent_since: dict[int, float] = {}  # ranks known silent before this clock first sees their beat

    def seed(self, rank: int, since: float) -> None:
        """Count ``rank`` as without progress since ``since`` from its first beat seen (a judge taking over from a
        silent one keeps the time it has already waited)."""
        self._silent_since[rank] = since

    def stalled(self, beats: dict[int, Beat]) -> dict[int, float]:
        now = self.clock()
        stalls = {}
        for rank, beat in beats.items():
            progress, since = self._seen.get(rank, (None, self._silent_since.pop(rank, now)))
            if progress is not None and progress != beat.progress:
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


class Watch:
    """One rank's side of the hang watch, one poll at a time: no thread and no Trainer (``HangSentinel``'s watchdog
    thread calls :meth:`poll`; tests and ``benchmarks/scale.py`` drive many simulated ranks through it).

    Rank 0 judges: each poll it reads every beat (O(W) keys in one round trip), judges them, and posts a
    :class:`Verdict` whose tick shows it is alive. Every other rank publishes its beat and reads the verdict: two
    store operations a poll, whatever W. A judge that goes silent does not blind the job: rank ``r`` takes over after
    ``(r - judge) x takeover_s`` without a new tick (the next rank first), and counts the silent judge's rank as
    without progress for as long as it has waited. Two judges never both post: a verdict changes only from the value
    its poster last saw (compare-and-set), and a judge that finds another's verdict steps down.
    """

    def __init__(
        self, board: Board, rank: int, world_size: int, takeover_s: float = 30.0, clock: Any = time.monotonic
    ) -> None:
        self.board, self.rank, self.world_size, self.takeover_s, self.clock = board, rank, world_size, takeover_s, clock
        self.judge = 0
        self.stalls = StallClock(clock)
        self._tick = 0
        self._posted = ""  # the verdict this rank last saw as judge (what compare-and-set expects)
        self._heard: tuple[tuple[int, int] | None, float] = (None, clock())  # the judge's last (rank, tick), when

    @property
    def judging(self) -> bool:
        return self.judge == self.rank

    def poll(self, beat: Beat) -> HangReport | None:
        """Publish ``beat``; judge or follow. The hang to act on, once one is found (by this rank or the judge)."""
        self.board.publish(beat)
        return self._judge() if self.judging else self._follow()

    def _judge(self) -> HangReport | None:
        beats = self.board.read()
        report = find_hang(beats, self.stalls.stalled(beats), self.world_size, self.rank)
        self._tick += 1
        desired = Verdict(self.rank, self._tick, asdict(report) if report else None).to_json()
        current = self.board.swap_verdict(self._posted, desired)
        if current == desired:
            self._posted = desired
            return report
        other = Verdict.from_json(current)  # another rank posted since: its hang, or its judging, holds
        if other.hang is not None:
            return HangReport(**other.hang)
        if other.judge != self.rank:
            log.info("HangSentinel: rank %d judges now; rank %d stands down", other.judge, self.rank)
            self.judge, self._heard = other.judge, ((other.judge, other.tick), self.clock())
        self._posted = current
        return None

    def _follow(self) -> HangReport | None:
        raw, now = self.board.read_verdict(), self.clock()
        if raw is not None:
            verdict = Verdict.from_json(raw)
            if verdict.hang is not None:
                return HangReport(**verdict.hang)
            self.judge = verdict.judge
            if (verdict.judge, verdict.tick) != self._heard[0]:
                self._heard = ((verdict.judge, verdict.tick), now)
        silent = now - self._heard[1]
        if silent <= ((self.rank - self.judge) % self.world_size) * self.takeover_s:
            return None
        log.warning(
            "HangSentinel: rank %d's judging went silent %.0f s ago; rank %d judges from now on",
            self.judge,
            silent,
            self.rank,
        )
        self.stalls.seed(self.judge, now - silent)
        self.judge, self._posted = self.rank, raw or ""
        return self._judge()
