"""Preemption-safe checkpointing: atomic (optionally async) writes, signal handling, exact auto-resume."""

from lightning_accel.checkpoint.atomic import AtomicCheckpointIO, CorruptCheckpointError, atomic_save, verify
from lightning_accel.checkpoint.preemption import EXIT_CODE_PREEMPTED, PreemptionCheckpoint
from lightning_accel.checkpoint.resume import find_resume_checkpoint, list_checkpoints

__all__ = [
    "EXIT_CODE_PREEMPTED",
    "AtomicCheckpointIO",
    "CorruptCheckpointError",
    "PreemptionCheckpoint",
    "atomic_save",
    "find_resume_checkpoint",
    "list_checkpoints",
    "verify",
]
