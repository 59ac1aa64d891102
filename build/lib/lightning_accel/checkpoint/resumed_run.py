"""What a fit resumes, beside the weights and the position: the shape of the run that saved (world size,
accumulation, per-device batch), a change of it followed or refused, and a run that had already finished.

``PreemptionCheckpoint`` holds one :class:`ResumedRun` per fit and calls it from its hooks; the arithmetic is in
``world_change.py`` (ranks) and ``batch_change.py`` (the per-device batch).
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch import Trainer

from lightning_accel.checkpoint.batch_change import SavedRun, follow_batch_change
from lightning_accel.checkpoint.loader_state import refuse_loaders_that_cannot_follow
from lightning_accel.checkpoint.world_change import WORLD_KEY, WorldChange, follow_world_change, world_of

__all__ = ["ResumedRun", "is_final_step", "nothing_left_to_train"]

log = logging.getLogger(__name__)


def _limit_reached(trainer: Trainer, epochs: int) -> bool:
    """``max_steps`` is reached, or ``epochs`` epochs reach ``max_epochs``."""
    by_steps = trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
    return by_steps or (trainer.max_epochs not in (None, -1) and epochs >= trainer.max_epochs)


def is_final_step(trainer: Trainer) -> bool:
    """No later step of this fit to move a save to: ``max_steps`` is reached, or this is the last epoch."""
    return _limit_reached(trainer, trainer.current_epoch + 1)


def nothing_left_to_train(trainer: Trainer) -> bool:
    """The fit's ``max_steps`` or ``max_epochs`` is reached: a resume from its last checkpoint trains nothing."""
    return _limit_reached(trainer, trainer.current_epoch)


class ResumedRun:
    """One fit's view of the checkpoint it resumed (nothing, on a fresh start)."""

    def __init__(self) -> None:
        self.configured_accumulation = 1  # what this attempt's Trainer says, before a resume changes it
        self.world_change: WorldChange | None = None  # the checkpoint was written on another world size
        self.saved: SavedRun | None = None
        self.resumed_at: int | None = None  # the global step of the checkpoint this fit resumed

    def reset(self, trainer: Trainer) -> None:
        """A new fit (``setup``)."""
        self.__init__()  # type: ignore[misc]
        self.configured_accumulation = int(trainer.accumulate_grad_batches)

    def record(self, trainer: Trainer, checkpoint: dict[str, Any]) -> None:
        """Write the run's shape into a checkpoint being saved."""
        checkpoint[WORLD_KEY] = world_of(trainer, self.configured_accumulation)

    def loaded(self, trainer: Trainer, checkpoint: dict[str, Any], callback_state_key: str) -> None:
        """``on_load_checkpoint``, before Lightning restores its loops: follow a change of world size."""
        self.saved = SavedRun.of(checkpoint, callback_state_key)  # before the world change re-counts its batches
        self.world_change = follow_world_change(trainer, checkpoint, callback_state_key)
        self.resumed_at = int(checkpoint.get("global_step", 0))

    def train_starts(self, trainer: Trainer) -> None:
        """``on_train_start``: the train loader exists and no step is taken; refuse or follow what changed."""
        if self.world_change is not None:
            refuse_loaders_that_cannot_follow(trainer.train_dataloader, self.world_change)
        follow_batch_change(trainer, self.saved, self.configured_accumulation)

    def fit_ends(self, trainer: Trainer) -> None:
        """``on_fit_end``: a rerun of a finished fit says so (it trained nothing and lost nothing)."""
        untouched = self.resumed_at is not None and trainer.global_step == self.resumed_at
        if untouched and nothing_left_to_train(trainer) and trainer.is_global_zero:
            log.warning(
                "this run had finished: the checkpoint it resumed ends the fit at step %d and nothing is left to "
                "train (max_steps=%s, max_epochs=%s); raise them to train on",
                self.resumed_at,
                trainer.max_steps,
                trainer.max_epochs,
            )
