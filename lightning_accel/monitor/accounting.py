"""GoodputAccounting: the goodput arithmetic with no Trainer in it, fed by :class:`GoodputMonitor`'s hooks.

Like Lightning's ``fabric/utilities/throughput.py`` ``Throughput`` beside its ``ThroughputMonitor``: counters go
in through :meth:`update`, :meth:`compute` gives the metrics, :meth:`state_dict` carries what must survive a
restart. Rates are differences of two :class:`Mark`\\ s, so nothing grows with the length of the run.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_accel.monitor.cost import COST_KEYS
from lightning_accel.monitor.ledger import BUCKETS, Ledger
from lightning_accel.monitor.membership import MEMBERSHIP_KEYS

__all__ = [
    "GOODPUT_KEYS",
    "INPUT_BOUND_SHARE",
    "METRIC_KEYS",
    "STRAGGLER_MADS",
    "STRAGGLER_MIN_EXCESS_S",
    "STRAGGLER_MIN_INTERVALS",
    "STRAGGLER_RATIO",
    "STRAGGLER_TWO_RANK_SHARE",
    "STRAGGLER_WINDOW",
    "THROUGHPUT_KEYS",
    "GoodputAccounting",
    "Mark",
    "input_bound_warning",
]

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
    "goodput/straggler_rank",
    "goodput/presync_step_s",
)
METRIC_KEYS = THROUGHPUT_KEYS + GOODPUT_KEYS + MEMBERSHIP_KEYS + COST_KEYS  # everything GoodputMonitor logs and exports
# A run is input bound when more than this share of its time (the ledger's `data` bucket over the whole run) waits
# for the train loader: GoodputMonitor's warning at the end of training and the doctor's input finding use this one
# number on the same share, so they agree.
INPUT_BOUND_SHARE = 0.10
STRAGGLER_WINDOW = 8  # logging intervals each rank's step time is the median of
STRAGGLER_RATIO = 1.2  # a rank is a straggler from this ratio of its step time to the other ranks' median ...
STRAGGLER_MADS = 3.0  # ... when its excess is also above this many (scaled) MADs of theirs: not their own noise
STRAGGLER_MIN_EXCESS_S = 0.005  # ... and at least this many seconds a step: a 1.3x of a 4 ms window is noise
STRAGGLER_MIN_INTERVALS = 3  # ... and never before this many intervals (a first step's compile, a one-off)
STRAGGLER_TWO_RANK_SHARE = 0.75  # with two ranks (one other, no spread): slower in this share of its intervals


@dataclass(frozen=True)
class Mark:
    """Counters at one moment (``steps``: global steps since this attempt's first)."""

    seconds: dict[str, float]
    forward_s: float
    batches: int
    steps: int
    samples: int
    tokens: int | None


class GoodputAccounting:
    """Seconds per bucket, samples, tokens and steps of one fit; throughput, MFU, goodput, lost work, stragglers.

    Args:
        flops_per_batch: FLOPs of one training micro-batch per device (``None``: no TFLOP/s or MFU).
        peak_flops: The device's peak FLOP/s for MFU (``None``: no MFU).
        clock: Wall clock for the ledger and lost-work time.
    """

    def __init__(
        self,
        flops_per_batch: float | None = None,
        peak_flops: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.flops_per_batch, self.peak_flops, self.clock = flops_per_batch, peak_flops, clock
        self.ledger = Ledger(clock)
        self.reset()

    def reset(self) -> None:
        """Forget everything: a new fit (restart counts come back through :meth:`load_state_dict`)."""
        self.batches = self.samples = 0
        self.start_step = self.step = 0  # global steps: this attempt's first, and the latest
        self.tokens: int | None = 0
        self.restarts = self.lost_steps = 0
        self.lost_s = 0.0
        self.straggler_ratio: float | None = None
        self.straggler_rank: int | None = None  # the slowest rank, once it passes both thresholds
        self.rank_step_s: list[float] = []  # each rank's windowed median pre-sync step time
        self.slowest_rank: int | None = None
        self._rank_times: deque[list[float]] = deque(maxlen=STRAGGLER_WINDOW)
        self.carried = dict.fromkeys(BUCKETS, 0.0)  # seconds of earlier attempts (from the checkpoint)
        self.carried_samples, self.carried_tokens = 0, 0  # this rank's, in earlier attempts (from the checkpoint)
        self.resumed = False
        self._redo_until: int | None = None
        self._attempt_start = 0.0

    # -- feeding ------------------------------------------------------------------------------------
    def update(self, samples: int, tokens: int | None, step: int) -> None:
        """One training micro-batch done, after which the trainer's global step is ``step``.

        ``tokens=None`` once means tokens are not counted for this run (the batches hold no token ids).
        """
        self.batches += 1
        self.samples += samples
        if self.tokens is not None:
            self.tokens = None if tokens is None else self.tokens + tokens
        self.step = step

    def mark(self) -> Mark:
        steps = self.step - self.start_step
        return Mark(self.ledger.snapshot(), self.ledger.forward_s, self.batches, steps, self.samples, self.tokens)

    def zero_mark(self) -> Mark:
        return Mark(dict.fromkeys(BUCKETS, 0.0), 0.0, 0, 0, 0, 0 if self.tokens is not None else None)

    # -- restarts -----------------------------------------------------------------------------------
    def begin_attempt(self, start_step: int, reached_step: int | None) -> int:
        """Training starts (again) at ``start_step``; the previous attempt had reached ``reached_step``.

        Returns the steps this attempt redoes (counted as lost; the time until it is back there is lost too).
        """
        self._attempt_start = self.clock()
        self.start_step = self.step = start_step
        if self.resumed:
            self.restarts += 1
        if not self.resumed or reached_step is None or reached_step <= start_step:
            return 0
        self.lost_steps += reached_step - start_step
        self._redo_until = reached_step
        return reached_step - start_step

    def reached(self, step: int) -> float | None:
        """An optimizer step finished at global step ``step``: the redone work ends once the old high is reached.
        Returns the seconds this attempt spent redoing it when this step ends it, else ``None``."""
        if self._redo_until is not None and step >= self._redo_until:
            return self._end_redo()
        return None

    def end_attempt(self) -> float | None:
        """Stopped before catching up with the previous attempt: all of this one was redone work (its seconds are
        returned, ``None`` when nothing was being redone)."""
        return self._end_redo() if self._redo_until is not None else None

    def _end_redo(self) -> float:
        redone = self.clock() - self._attempt_start
        self.lost_s += redone
        self._redo_until = None
        return redone

    # -- stragglers ---------------------------------------------------------------------------------
    @staticmethod
    def own_step_time(before: Mark, after: Mark) -> float:
        """Seconds per optimizer step a rank spent before the gradient sync: its data, transfer and forward.

        In synchronous data parallelism every rank ends a step together (the fast ones wait inside backward's
        all-reduce), so wall step times cannot show a straggler; this can.
        """
        steps = max(after.steps - before.steps, 1)
        data = sum(after.seconds[b] - before.seconds[b] for b in ("data", "transfer"))
        return (data + after.forward_s - before.forward_s) / steps

    def set_rank_step_times(self, per_rank: list[float]) -> None:
        """Every rank's :meth:`own_step_time` over one logging interval, in rank order.

        Each rank's time is the median of its last :data:`STRAGGLER_WINDOW` intervals, so one slow interval (a
        hiccup) names no straggler. The ratio compares the slowest rank with the median of the *other* ranks (with
        two ranks, the other one). The slowest rank is named a straggler when the ratio reaches
        :data:`STRAGGLER_RATIO` and its excess is above :data:`STRAGGLER_MADS` scaled median absolute deviations of
        the others' times, so a cluster whose ranks all vary widely names no one. With two ranks there is no spread
        of others: the rank's own history stands in, and it must have been the slower one in
        :data:`STRAGGLER_TWO_RANK_SHARE` of the intervals. Never from fewer than :data:`STRAGGLER_MIN_INTERVALS`
        intervals, nor for an excess under :data:`STRAGGLER_MIN_EXCESS_S` a step.
        """
        if self._rank_times and len(self._rank_times[-1]) != len(per_rank):
            self._rank_times.clear()  # another world size: earlier intervals do not compare
        self._rank_times.append(list(per_rank))
        medians = [statistics.median(interval[r] for interval in self._rank_times) for r in range(len(per_rank))]
        self.rank_step_s = medians
        self.slowest_rank = max(range(len(medians)), key=medians.__getitem__)
        others = [m for r, m in enumerate(medians) if r != self.slowest_rank] or medians
        typical = statistics.median(others)
        self.straggler_ratio = medians[self.slowest_rank] / typical if typical > 0 else 1.0
        excess = medians[self.slowest_rank] - typical
        if len(per_rank) == 2:
            slower = sum(interval[self.slowest_rank] > interval[1 - self.slowest_rank] for interval in self._rank_times)
            stands_out = slower >= STRAGGLER_TWO_RANK_SHARE * len(self._rank_times)
        else:
            mad = 1.4826 * statistics.median(abs(m - typical) for m in others)  # 1.4826: a standard deviation's scale
            stands_out = excess > STRAGGLER_MADS * mad
        named = (
            len(self._rank_times) >= STRAGGLER_MIN_INTERVALS
            and self.straggler_ratio >= STRAGGLER_RATIO
            and excess >= STRAGGLER_MIN_EXCESS_S
            and stands_out
        )
        self.straggler_rank = self.slowest_rank if named else None

    @property
    def straggler_intervals(self) -> int:
        """How many logging intervals the ranks' step times are medians of (at most :data:`STRAGGLER_WINDOW`)."""
        return len(self._rank_times)

    # -- metrics ------------------------------------------------------------------------------------
    def rates(self, before: Mark, after: Mark, world_size: int = 1) -> dict[str, float]:
        """Throughput between two marks, over training time (wall time less validation); per-device rates times
        ``world_size`` for the global ones."""
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
            if self.peak_flops:
                metrics["throughput/mfu"] = achieved / self.peak_flops
        return metrics

    def total_seconds(self) -> dict[str, float]:
        """Seconds per bucket over the whole run: earlier attempts' and this one's so far."""
        now = self.ledger.snapshot() if self.ledger.running else self.ledger.seconds
        return {b: self.carried[b] + now[b] for b in BUCKETS}

    def goodput(self) -> dict[str, float]:
        seconds = self.total_seconds()
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
            metrics["goodput/straggler_rank"] = float(self.straggler_rank if self.straggler_rank is not None else -1)
        return metrics

    def compute(self, since: Mark | None, world_size: int = 1) -> dict[str, float]:
        """The end-of-run figures: throughput from ``since`` (the end of warm-up; ``None`` or a run shorter than
        the warm-up: from the start) to now, and the goodput of the whole run."""
        end = self.mark()
        start = since if since is not None and since.batches != end.batches else self.zero_mark()
        results = self.rates(start, end, world_size)
        results["throughput/batches_measured"] = float(end.batches - start.batches)
        results["throughput/steps_measured"] = float(end.steps - start.steps)
        results.update(self.goodput())
        return results

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.total_seconds(),
            "restarts": self.restarts,
            "lost_steps": self.lost_steps,
            "lost_s": self.lost_s,
            "samples": self.run_samples(),
            "tokens": self.run_tokens(),
        }

    def run_samples(self) -> int:
        """This rank's samples over the whole run: earlier attempts' and this one's."""
        return self.carried_samples + self.samples

    def run_tokens(self) -> int | None:
        """This rank's tokens over the whole run (``None``: not counted)."""
        return None if self.tokens is None else self.carried_tokens + self.tokens

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.carried = {b: float(state_dict.get("seconds", {}).get(b, 0.0)) for b in BUCKETS}
        self.restarts = int(state_dict.get("restarts", 0))
        self.lost_steps = int(state_dict.get("lost_steps", 0))
        self.lost_s = float(state_dict.get("lost_s", 0.0))
        self.carried_samples = int(state_dict.get("samples", 0))
        self.carried_tokens = int(state_dict.get("tokens") or 0)
        self.resumed = True


def input_bound_warning(results: dict[str, float], threshold: float = INPUT_BOUND_SHARE) -> str | None:
    """The warning for a run that waited for its train loader more than ``threshold`` of its time (the whole run's
    data share: what the doctor's input finding judges), or ``None``."""
    share = float(results.get("goodput/data_share", 0.0))
    if share <= threshold:
        return None
    return (
        f"Input pipeline bound: {share:.0%} of the run waited for the train loader (threshold {threshold:.0%}, the "
        "doctor's too). Raise num_workers, use pin_memory, or decode and augment with DALI "
        "(lightning_accel.DALIImageDataModule); `lightning-accel doctor` names the fix."
    )
