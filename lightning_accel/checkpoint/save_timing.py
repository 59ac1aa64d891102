"""How long saves take from start to durable on disk, against the grace period a preemption leaves for one."""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_warn

from lightning_accel.checkpoint.async_io import AsyncWrite

__all__ = ["SaveTimer"]


class SaveTimer:
    """Each save's start-to-durable seconds in :attr:`seconds`; the first one over ``grace_period_s`` warns, with
    the numbers and the fixes (once: the saves after it are no news). A synchronous save is timed at once; an async
    one when its write is durable."""

    def __init__(self, grace_period_s: float) -> None:
        if grace_period_s <= 0:
            raise ValueError(f"grace_period_s must be positive, got {grace_period_s}")
        self.grace_period_s = grace_period_s
        self.seconds: list[float] = []
        self._warned = False
        self._untimed: tuple[float, AsyncWrite] | None = None  # an async save's start, until its write is durable

    def reset(self) -> None:
        self.seconds, self._warned, self._untimed = [], False, None

    def wait_for(self, started: float, write: AsyncWrite) -> None:
        """An async save that started at ``started`` (monotonic clock): timed once ``write`` is durable."""
        self._untimed = (started, write)

    def record_finished_write(self) -> None:
        if self._untimed is not None and self._untimed[1].finished is not None:
            started, write = self._untimed
            self.record(write.finished - started)
            self._untimed = None

    def record(self, seconds: float) -> None:
        self.seconds.append(seconds)
        if self._warned or seconds <= self.grace_period_s:
            return
        self._warned = True
        rank_zero_warn(
            f"PreemptionCheckpoint: a save took {seconds:.1f} s from start to durable, over the "
            f"{self.grace_period_s:g} s grace period between a preemption signal and SIGKILL "
            "(grace_period_s): a save at the signal would be cut off, and the run would resume from the "
            "previous checkpoint (writes are atomic: it stays valid). Fixes: a faster disk for dirpath; "
            "more frequent periodic saves (every_n_steps / every_n_seconds; async_save=True keeps them from "
            "stalling training) so that less is lost; a longer grace period where you can set one (Kubernetes "
            "terminationGracePeriodSeconds, Slurm --signal=SIGTERM@<seconds>)."
        )
