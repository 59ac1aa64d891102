"""A resume whose per-device batch changed (with the world size or without): the position counted in samples of
the global order, the global batch kept by re-counting gradient accumulation, or the resume refused before the first
step, naming the sizes and the fix.

``world_change.py`` re-counts a change of world size when the checkpoint loads, in per-rank batches, before the
train loader exists. The loader's batch size is known only once Lightning has built it, at ``on_train_start`` and
still before the first batch: this module checks it then and corrects the accumulation and the fit loop's batch
counters, which Lightning reads only when the epoch starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_accel._compat import set_train_batches_done, train_batches_in_checkpoint
from lightning_accel.checkpoint.loader_state import flat_loaders, train_batch_size
from lightning_accel.checkpoint.world_change import CONFIGURED_KEY, saved_world
from lightning_accel.contracts import follows_world_size, is_stateful

__all__ = ["BatchChange", "SavedRun", "follow_batch_change", "plan_batch_change"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavedRun:
    """What a checkpoint records of the run that wrote it: its world record (``world_change.world_of``), its
    per-device batch (``None``: unknown) and the batches of the epoch each rank had trained."""

    world: dict[str, Any] | None
    batch: int | None
    batches_done: int

    @classmethod
    def of(cls, checkpoint: dict[str, Any], callback_state_key: str) -> SavedRun:
        """Read from ``checkpoint`` as loaded, before a world change re-counts its batches. The batch is the one
        recorded beside the world size, or, for checkpoints written before that record, the one train loader's
        saved state (``ResumableDataLoader`` keeps it)."""
        world = saved_world(checkpoint, callback_state_key)
        batch = world.get("batch_size") if world else None
        states = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader")
        if batch is None and isinstance(states, list) and len(states) == 1 and isinstance(states[0], dict):
            batch = states[0].get("batch_size")
        batch = batch if isinstance(batch, int) and not isinstance(batch, bool) else None
        return cls(world, batch, train_batches_in_checkpoint(checkpoint))


@dataclass(frozen=True)
class BatchChange:
    """The saved run trained ``saved_batch`` per device on ``saved_world`` ranks accumulating ``saved_accumulation``;
    this one trains ``batch`` on ``world`` ranks accumulating ``accumulation``, ``batches_done`` of the epoch's
    batches per rank done (the saved samples re-counted in the new batches)."""

    saved_batch: int
    saved_world: int
    saved_accumulation: int
    batch: int
    world: int
    accumulation: int
    batches_done: int

    @property
    def saved_global_batch(self) -> int:
        return self.saved_batch * self.saved_world * self.saved_accumulation

    @property
    def global_batch(self) -> int:
        return self.batch * self.world * self.accumulation

    def __str__(self) -> str:
        return (
            f"per-device batch {self.saved_batch} -> {self.batch} on {self.saved_world} -> {self.world} rank(s), "
            f"accumulate_grad_batches {self.saved_accumulation} -> {self.accumulation}"
        )


def plan_batch_change(
    saved: dict[str, Any],
    saved_batch: int,
    saved_batches_done: int,
    batch: int,
    world: int,
    user_accumulation: int | None,
) -> BatchChange:
    """How a run saved by ``saved`` (its world record: ``world_size`` and ``accumulate_grad_batches``), training
    ``saved_batch`` per device and ``saved_batches_done`` batches into its epoch on each rank, goes on with ``batch``
    per device on ``world`` ranks. ``user_accumulation`` is an accumulation the user chose for this attempt (it then
    holds and the global batch may change); ``None`` keeps the saved global batch.

    Raises ``ValueError``, naming the sizes and the fix, where the global batch or the position cannot be kept.
    """
    saved_world, saved_accumulation = int(saved["world_size"]), int(saved["accumulate_grad_batches"] or 1)
    global_batch = saved_batch * saved_world * saved_accumulation
    per_step = batch * world  # samples of one micro-batch on every rank
    if user_accumulation is not None:
        accumulation = user_accumulation
    elif global_batch % per_step:
        fits = [b for b in range(1, global_batch // world + 1) if global_batch % (b * world) == 0]
        raise ValueError(
            f"PreemptionCheckpoint: this checkpoint was trained with a per-device batch of {saved_batch} on "
            f"{saved_world} rank(s) accumulating {saved_accumulation}, a global batch of {global_batch} samples; a "
            f"per-device batch of {batch} on {world} rank(s) cannot make it up ({per_step} samples a micro-batch), so "
            f"the resume would not be the same training. Use a per-device batch in {fits} on {world} rank(s), or "
            "pass Trainer(accumulate_grad_batches=N) to choose another global batch yourself."
        )
    else:
        accumulation = global_batch // per_step
    samples = saved_batches_done * saved_world * saved_batch
    if samples % per_step:
        raise ValueError(
            f"PreemptionCheckpoint: this checkpoint stops {samples} samples into its epoch ({saved_batches_done} "
            f"batch(es) of {saved_batch} on each of {saved_world} rank(s)), not a whole number of batches of {batch} "
            f"on each of {world} rank(s). Resume with a per-device batch of {saved_batch}, or one that divides "
            f"{samples // world if samples % world == 0 else samples} samples per rank."
        )
    return BatchChange(
        saved_batch, saved_world, saved_accumulation, batch, world, accumulation, batches_done=samples // per_step
    )


def follow_batch_change(
    trainer: Trainer, saved_run: SavedRun | None, configured_accumulation: int
) -> BatchChange | None:
    """At ``on_train_start`` of a resumed fit: when the train loader's per-device batch differs from the saved one,
    plan the change (:func:`plan_batch_change`) and apply it to the Trainer, or raise before the first step.

    ``configured_accumulation`` is what this attempt's Trainer was given: it is the user's choice when it differs
    from what the saving attempt's Trainer was given, as in ``world_change.plan_world_change``.
    """
    batch = train_batch_size(trainer.train_dataloader)
    if saved_run is None or not saved_run.world or saved_run.batch is None or batch in (None, saved_run.batch):
        return None
    saved, saved_batch, saved_batches_done = saved_run.world, saved_run.batch, saved_run.batches_done
    for loader in flat_loaders(trainer.train_dataloader):
        if is_stateful(loader) and not follows_world_size(loader):
            raise ValueError(
                f"PreemptionCheckpoint: the per-device batch changed from {saved_batch} to {batch}, but the train "
                f"loader ({type(loader).__name__}) saved its position in its own batches, which do not map onto "
                f"batches of {batch}. Resume with batch_size={saved_batch}, or use "
                "lightning_accel.ResumableDataLoader (its position is a point in one global order)."
            )
    saved_configured = saved.get(CONFIGURED_KEY) or saved["accumulate_grad_batches"]
    chosen = configured_accumulation if configured_accumulation != saved_configured else None
    change = plan_batch_change(saved, saved_batch, saved_batches_done, batch, trainer.world_size, chosen)
    trainer.accumulate_grad_batches = change.accumulation
    set_train_batches_done(trainer, change.batches_done)
    if trainer.is_global_zero:
        log.warning(
            "resuming with another per-device batch: %s; the global batch is %d samples (it was %d) and the epoch "
            "goes on from sample %d of its global order (%d of this epoch's batches per rank done)",
            change,
            change.global_batch,
            change.saved_global_batch,
            saved_batches_done * change.saved_world * change.saved_batch,
            change.batches_done,
        )
    if change.global_batch != change.saved_global_batch:
        rank_zero_warn(
            f"PreemptionCheckpoint: the global batch changes on this resume ({change}): an optimizer step now "
            f"averages {change.global_batch} samples instead of {change.saved_global_batch}, as the Trainer's "
            "accumulate_grad_batches asks."
        )
    rank_zero_warn(
        f"PreemptionCheckpoint: resumed with a per-device batch of {batch} from {saved_batch}. Exact: the samples of "
        "the rest of the epoch and of each optimizer step, the steps, LR schedule and epoch. Not the uninterrupted "
        "run's: BatchNorm statistics (taken over the new batches), random draws in training_step, and the weights, "
        "to float rounding (docs/checkpointing.md, 'Another world size')."
    )
    return change
