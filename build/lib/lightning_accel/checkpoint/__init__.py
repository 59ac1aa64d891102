"""Preemption-safe checkpointing: atomic (optionally async) writes, signal handling, exact auto-resume."""

from lightning_accel.checkpoint.async_io import AsyncAtomicCheckpointIO, AsyncWrite
from lightning_accel.checkpoint.atomic import AtomicCheckpointIO, CorruptCheckpointError, atomic_save
from lightning_accel.checkpoint.cloud_notices import PreemptionNotices
from lightning_accel.checkpoint.durable import Verdict
from lightning_accel.checkpoint.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionCheckpoint
from lightning_accel.checkpoint.resume import find_resume_checkpoint, list_checkpoints
from lightning_accel.checkpoint.signals import EXIT_CODE_PREEMPTED as EXIT_CODE_PREEMPTED  # the earlier name
from lightning_accel.checkpoint.verify import verify

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "AsyncAtomicCheckpointIO",
    "AsyncWrite",
    "AtomicCheckpointIO",
    "CorruptCheckpointError",
    "Preempted",
    "PreemptionCheckpoint",
    "PreemptionNotices",
    "Verdict",
    "atomic_save",
    "find_resume_checkpoint",
    "list_checkpoints",
    "verify",
]
