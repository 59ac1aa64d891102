"""Preemption-safe checkpointing: atomic (optionally async) writes, signal handling, exact auto-resume."""

from lightning_accel.checkpoint.atomic import (
    AsyncAtomicCheckpointIO,
    AtomicCheckpointIO,
    CorruptCheckpointError,
    Verdict,
    atomic_save,
    verify,
)
from lightning_accel.checkpoint.preemption import EXIT_CODE_PREEMPTED, Preempted, PreemptionCheckpoint
from lightning_accel.checkpoint.resume import find_resume_checkpoint, list_checkpoints

__all__ = [
    "EXIT_CODE_PREEMPTED",
    "AsyncAtomicCheckpointIO",
    "AtomicCheckpointIO",
    "CorruptCheckpointError",
    "Preempted",
    "PreemptionCheckpoint",
    "Verdict",
    "atomic_save",
    "find_resume_checkpoint",
    "list_checkpoints",
    "verify",
]
