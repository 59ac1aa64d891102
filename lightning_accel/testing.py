"""Trainer settings for tests and benchmarks: train only, print nothing, write nothing.

Used by this project's tests, test scripts and benchmarks, and useful in a user's own tests of a
module trained with lightning-accel::

    Trainer(**quiet_trainer_kwargs(max_steps=10))
"""

from __future__ import annotations

from typing import Any

__all__ = ["QUIET_TRAINER", "quiet_trainer_kwargs"]

# No logger, checkpoints, progress bar, summary, sanity check or validation.
QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def quiet_trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """:data:`QUIET_TRAINER` updated with ``overrides`` (a new dict each call)."""
    return {**QUIET_TRAINER, **overrides}
