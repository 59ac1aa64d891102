"""A resume on another number of ranks (nodes left or joined): the global batch kept by re-counting gradient
accumulation, the fit loop's per-rank batch counters re-counted, and what cannot follow refused or named.

The data position itself is the loader's (``ResumableDataLoader`` saves a point in one global order); this module
makes the rest of the run agree with it: an optimizer step still averages ``batch x accumulation x world size``
samples, and Lightning's ``batch_idx``, accumulation boundaries and epoch end count the new per-rank batches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_warn

from lightning_accel._compat import rescale_train_batches, train_batches_in_checkpoint
from lightning_accel.checkpoint.loader_state import train_batch_size
from lightning_accel.contracts import follows_world_size

__all__ = [
    "CONFIGURED_KEY",
    "WORLD_KEY",
    "WorldChange",
    "accumulation_to_keep",
    "apply_world_change",
    "follow_world_change",
    "plan_world_change",
    "saved_world",
    "world_of",
]

log = logging.getLogger(__name__)

WORLD_KEY = "lightning_accel_world"  # the world size and accumulation that wrote a checkpoint
CONFIGURED_KEY = "configured_accumulate_grad_batches"  # what that attempt's Trainer(accumulate_grad_batches=) said


def world_of(trainer: Trainer, configured_accumulation: int | None = None) -> dict[str, int | None]:
    """What a checkpoint records of the run that writes it: its world size, accumulation and per-device batch (the
    one train loader's; ``None`` when unknown), and the accumulation its Trainer was given
    (``configured_accumulation``, before a resume changed it), which tells a later attempt's unchanged script from a
    new choice."""
    accumulation = int(trainer.accumulate_grad_batches)
    return {
        "world_size": trainer.world_size,
        "accumulate_grad_batches": accumulation,
        CONFIGURED_KEY: configured_accumulation or accumulation,
        "batch_size": train_batch_size(trainer.train_dataloader),
    }


@dataclass(frozen=True)
class WorldChange:
    """The run resumes on ``world_size`` ranks a checkpoint written on ``saved_world_size``."""

    saved_world_size: int
    world_size: int
    saved_accumulation: int
    accumulation: int

    @property
    def keeps_global_batch(self) -> bool:
        return self.saved_accumulation * self.saved_world_size == self.accumulation * self.world_size

    def __str__(self) -> str:
        return (
            f"{self.saved_world_size} -> {self.world_size} rank(s), accumulate_grad_batches "
            f"{self.saved_accumulation} -> {self.accumulation}"
        )


def follow_world_change(trainer: Trainer, checkpoint: dict[str, Any], callback_state_key: str) -> WorldChange | None:
    """When ``checkpoint`` was written on another number of ranks: plan the change and apply it to ``trainer`` and
    ``checkpoint`` (call before Lightning restores its loops); the change, or ``None`` at the same size. At the same
    size, the accumulation an earlier change chose is kept (the script still says the first attempt's)."""
    saved = saved_world(checkpoint, callback_state_key)
    kept = accumulation_to_keep(saved, trainer)
    if kept is not None:
        log.info(
            "keeping accumulate_grad_batches=%d, which this run chose when its world size changed (the Trainer says "
            "%d, as in the attempt that started it)",
            kept,
            trainer.accumulate_grad_batches,
        )
        trainer.accumulate_grad_batches = kept
    change = plan_world_change(saved, trainer)
    if change is not None:
        apply_world_change(change, trainer, checkpoint)
    return change


def accumulation_to_keep(saved: dict[str, Any] | None, trainer: Trainer) -> int | None:
    """At the size that saved, the saved accumulation where it differs from the Trainer's only because an earlier
    resume changed it (the Trainer still says what the saving attempt was configured with); else ``None``."""
    if not saved or saved["world_size"] != trainer.world_size or not saved.get("accumulate_grad_batches"):
        return None
    accumulation, configured = saved["accumulate_grad_batches"], saved.get(CONFIGURED_KEY)
    unchanged_script = configured is not None and trainer.accumulate_grad_batches == configured
    return accumulation if unchanged_script and accumulation != configured else None


def saved_world(checkpoint: dict[str, Any], callback_state_key: str) -> dict[str, Any] | None:
    """What ``checkpoint`` records of the run that wrote it; for checkpoints from before :data:`WORLD_KEY`, the world
    size in PreemptionCheckpoint's state (``callback_state_key``), with the accumulation taken as unchanged."""
    if WORLD_KEY in checkpoint:
        return checkpoint[WORLD_KEY]
    size = checkpoint.get("callbacks", {}).get(callback_state_key, {}).get("world_size")
    return {"world_size": size, "accumulate_grad_batches": None} if size else None


def plan_world_change(saved: dict[str, Any] | None, trainer: Trainer) -> WorldChange | None:
    """The change from the run that wrote ``saved`` (:func:`world_of`) to this one; ``None`` at the same size.

    Raises ``ValueError`` when the saved global batch does not split evenly over the new ranks and the user has not
    chosen an accumulation of their own.
    """
    if not saved or saved["world_size"] == trainer.world_size:
        return None
    before, now = saved["world_size"], trainer.world_size
    accumulation = saved["accumulate_grad_batches"] or int(trainer.accumulate_grad_batches)
    configured = saved.get(CONFIGURED_KEY) or accumulation  # what the saving attempt's Trainer was given
    if trainer.accumulate_grad_batches != configured:  # the user chose one for the new size: theirs holds
        return WorldChange(before, now, accumulation, int(trainer.accumulate_grad_batches))
    per_step = accumulation * before  # per-rank batches in one optimizer step, all ranks together
    if per_step % now:
        fits = [n for n in range(1, per_step + 1) if per_step % n == 0]
        raise ValueError(
            f"PreemptionCheckpoint: this checkpoint was written by {before} rank(s) accumulating {accumulation} "
            f"batch(es) per optimizer step, {per_step} per-rank batches a step; {now} rank(s) cannot share that "
            f"evenly, so the global batch and the data position cannot both be kept. Resume on {fits} rank(s), or "
            "pass Trainer(accumulate_grad_batches=N) to choose another global batch yourself."
        )
    return WorldChange(before, now, accumulation, per_step // now)


def apply_world_change(change: WorldChange, trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Set the new accumulation and re-count the fit loop's batches in ``checkpoint`` (before Lightning reads it)."""
    if isinstance(trainer.strategy, DeepSpeedStrategy) and not follows_world_size(trainer.strategy):
        raise ValueError(
            f"PreemptionCheckpoint: resuming a DeepSpeed checkpoint on another number of ranks ({change}) needs "
            "DeepSpeed's universal checkpoint, which Lightning's DeepSpeedStrategy does not load. Train with our "
            "presets (strategy='accel_zero2' or 'accel_zero3': they convert and load it), resume on "
            f"{change.saved_world_size} rank(s), or use strategy='accel_fsdp' or 'ddp' (docs/distributed.md, "
            "'Spot fleets')."
        )
    done = train_batches_in_checkpoint(checkpoint)
    if (done * change.saved_world_size) % change.world_size:
        raise ValueError(
            f"PreemptionCheckpoint: this checkpoint stops {done} batch(es) into the epoch on each of "
            f"{change.saved_world_size} rank(s), not a whole number of batches on each of {change.world_size}: it "
            "was not written at an optimizer step of the saved global batch. Resume from a PreemptionCheckpoint "
            f"checkpoint, or on {change.saved_world_size} rank(s)."
        )
    trainer.accumulate_grad_batches = change.accumulation
    rescale_train_batches(checkpoint, change.saved_world_size, change.world_size)
    if trainer.is_global_zero:
        log.warning(
            "resuming on another number of ranks: %s; the epoch goes on from where the saved run stopped in its "
            "global order (%d of this epoch's batches per rank done)",
            change,
            done * change.saved_world_size // change.world_size,
        )
    if not change.keeps_global_batch:
        rank_zero_warn(
            f"PreemptionCheckpoint: the global batch changes on this resume ({change}): an optimizer step now "
            f"averages {change.accumulation * change.world_size} per-rank batches instead of "
            f"{change.saved_accumulation * change.saved_world_size}, as the Trainer's accumulate_grad_batches asks."
        )
    if not trainer.lightning_module.automatic_optimization:
        rank_zero_warn(
            "PreemptionCheckpoint: with manual optimization, each rank steps when its own training_step says so, so "
            f"an optimizer step covers the batches of {change.world_size} rank(s) now, not {change.saved_world_size}: "
            "the data order goes on exactly, the global batch does not."
        )
    rank_zero_warn(
        f"PreemptionCheckpoint: resumed on {change.world_size} rank(s) from {change.saved_world_size}. Exact: the "
        "samples and batches of the rest of the epoch, optimizer steps, LR schedule, epoch. Not the uninterrupted "
        "run's: random draws in training_step (dropout), since a rank now draws for batches another rank drew for "
        "and ranks that joined take generators derived from rank 0's (the same on every resume of this checkpoint "
        "at this size); the interrupted epoch's logged values, which start over; BatchNorm running statistics under "
        "DDP (rank 0's); and the weights, to float rounding (docs/checkpointing.md, 'Another world size')."
    )
