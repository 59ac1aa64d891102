"""The goodput ledger: every second of a fit charged to exactly one bucket, where it happens.

Time is charged at Lightning's own instrumentation points: the Trainer calls ``profiler.start(name)`` /
``profiler.stop(name)`` around fetching a batch (``[_TrainingEpochLoop].train_dataloader_next``), moving it
(``[Strategy]X.batch_to_device``), the training step with backward and optimizer step (``run_training_batch``)
and every ``trainer.save_checkpoint`` (``save_checkpoint``: ``ModelCheckpoint``, ``PreemptionCheckpoint``, a
user's own call). :class:`LedgerProfiler` sits in front of the user's profiler, forwards every call to it and
charges the time on the way. ``TorchCompile`` announces first-call compilation the same way
(``torch_compile``). Regions nest (a save inside validation, compilation inside a training step): the
innermost one is charged, so the buckets never overlap and always add up to the wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.pytorch.profilers import PassThroughProfiler, Profiler
from typing_extensions import override

from lightning_accel.monitor.forwarding import ForwardingProfiler
from lightning_accel.phases import phase_of

__all__ = ["BUCKETS", "EXCLUDED", "FORWARD", "TRAIN_BUCKETS", "Ledger", "LedgerProfiler", "bucket_of"]

BUCKETS = ("data", "transfer", "compute", "checkpoint", "validation", "compile", "other")
TRAIN_BUCKETS = frozenset({"data", "transfer", "compute"})
FORWARD = "forward"  # not a bucket: forward time inside `compute`, for the straggler check
EXCLUDED = "excluded"  # not a bucket: the profiler's own work (trace export), left out of the run's time
_NOTHING = nullcontext()  # reusable: entering and leaving it does nothing


# The ledger's bucket for each phase of the shared table; the phases inside a training step (backward, optimizer)
# are already charged to `compute` by the step's own action.
_BUCKET_OF_PHASE: dict[str, str] = {
    "data": "data",
    "transfer": "transfer",
    "step": "compute",
    "forward": FORWARD,
    "checkpoint": "checkpoint",
    "compile": "compile",
    "profiler_overhead": EXCLUDED,
}


def bucket_of(action: str) -> str | None:
    """Bucket charged for a Lightning profiler action, ``FORWARD`` for the training step, else ``None``."""
    phase = phase_of(action)
    return None if phase is None else _BUCKET_OF_PHASE.get(phase)


class Ledger:
    """Exclusive wall-time accounting over nested regions; time outside every region is ``other``.

    Inside ``validation``, the training buckets (a validation batch's transfer, say) stay ``validation``.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None) -> None:
        self.clock = clock
        self.sync = sync  # torch.cuda.synchronize on a GPU: queued kernels are charged to the region that queued them
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.forward_s = 0.0
        self._stack: list[tuple[str, str]] = []  # (requested, charged)
        self._since: float | None = None
        self._forward_since: float | None = None

    @property
    def running(self) -> bool:
        return self._since is not None

    def start(self) -> None:
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.forward_s, self._stack, self._forward_since = 0.0, [], None
        self._since = self.clock()

    def stop(self) -> None:
        if self._since is not None:
            self._charge(self.clock())
        self._since, self._stack = None, []

    def _charge(self, now: float) -> None:
        assert self._since is not None
        bucket = self._stack[-1][1] if self._stack else "other"
        if bucket != EXCLUDED:
            self.seconds[bucket] += now - self._since
        self._since = now

    def enter(self, bucket: str) -> None:
        if self._since is None:
            return
        if bucket == FORWARD:
            self._forward_since = self.clock()
            return
        if self.sync is not None and bucket in ("checkpoint", "validation"):
            self.sync()
        self._charge(self.clock())
        charged = bucket
        if self._stack and self._stack[-1][1] == "validation" and bucket in TRAIN_BUCKETS:
            charged = "validation"
        self._stack.append((bucket, charged))

    def exit(self, bucket: str) -> None:
        if self._since is None:
            return
        if bucket == FORWARD:
            if self._forward_since is not None:
                self.forward_s += self.clock() - self._forward_since
                self._forward_since = None
            return
        if self.sync is not None and bucket == "compute":
            self.sync()
        self._charge(self.clock())
        for i in range(len(self._stack) - 1, -1, -1):  # the innermost region of that name
            if self._stack[i][0] == bucket:
                del self._stack[i]
                return

    def snapshot(self) -> dict[str, float]:
        """Seconds per bucket up to now (the open region charged so far)."""
        if self._since is not None:
            self._charge(self.clock())
        return dict(self.seconds)


class LedgerProfiler(ForwardingProfiler):
    """Lightning profiler that forwards everything to ``inner`` and charges ``ledger`` on the way.

    Installed as ``trainer.profiler`` for one fit by ``GoodputMonitor`` and removed at teardown, so a user's
    ``Trainer(profiler="simple")`` still sees every action.
    """

    def __init__(self, inner: Profiler, ledger: Ledger) -> None:
        super().__init__(inner)
        self.ledger = ledger
        self._buckets: dict[str, str | None] = {}
        # Lightning's default profiler does nothing: then the ~30 actions per batch that charge no bucket
        # cost one dict lookup here, less than Lightning's own context manager would.
        self._silent_inner = type(inner) is PassThroughProfiler

    def _bucket(self, action: str) -> str | None:
        try:
            return self._buckets[action]
        except KeyError:
            bucket = self._buckets[action] = bucket_of(action)
            return bucket

    @override
    def profile(self, action_name: str) -> AbstractContextManager[Any]:
        if self._silent_inner and self._bucket(action_name) is None:
            return _NOTHING
        return super().profile(action_name)

    @override
    def start(self, action_name: str) -> None:
        bucket = self._bucket(action_name)
        if bucket is not None:
            self.ledger.enter(bucket)
        if not self._silent_inner:
            self.inner.start(action_name)

    @override
    def stop(self, action_name: str) -> None:
        if not self._silent_inner:
            self.inner.stop(action_name)
        bucket = self._bucket(action_name)
        if bucket is not None:
            self.ledger.exit(bucket)
