"""How far a run is: the highest step reached, kept in the run folder so that a resumed attempt knows what it
redoes, and the steps left to the end of the fit.

Checkpoints hold the step they were saved at; the step a killed attempt had reached is lost with it. This
small file, replaced atomically (write, then ``os.replace``) at most once a second, keeps it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from lightning.pytorch import Trainer

from lightning_accel.storage import parse_json_object

__all__ = ["PROGRESS_FILE", "last_progress_time", "read_highest_step", "steps_left", "write_highest_step"]

log = logging.getLogger(__name__)

PROGRESS_FILE = "goodput_progress.json"


def read_highest_step(run_dir: str | Path) -> int | None:
    """The step recorded in ``run_dir``, or ``None`` when there is none (or it is unreadable, with a warning)."""
    path = Path(run_dir) / PROGRESS_FILE
    try:
        step = (parse_json_object(path.read_bytes()) or {}).get("highest_step")
    except FileNotFoundError:
        return None
    except OSError as err:
        step = err
    if type(step) is not int:  # not trusted (storage.trust): unreadable, torn or hostile
        log.warning("Ignoring unreadable %s (%r): lost work of the previous attempt is not counted", path, step)
        return None
    return step


def last_progress_time(run_dir: str | Path) -> float | None:
    """When the step in ``run_dir`` was recorded (wall clock; ``None`` when unknown)."""
    try:
        at = (parse_json_object((Path(run_dir) / PROGRESS_FILE).read_bytes()) or {}).get("at")
    except OSError:
        return None
    return float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at) else None


def write_highest_step(run_dir: str | Path, step: int) -> None:
    """Record ``step`` and the time, atomically; a failure (read-only or full disk) is logged, never raised."""
    folder = Path(run_dir)
    tmp = folder / f".{PROGRESS_FILE}.tmp-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"highest_step": int(step), "at": time.time()}))
        os.replace(tmp, folder / PROGRESS_FILE)
    except OSError as err:
        log.warning("Cannot record progress in %s (%s): a restart will not know the work it redoes", folder, err)
        tmp.unlink(missing_ok=True)


def steps_left(trainer: Trainer) -> int | None:
    """Optimizer steps to the end of the fit: from ``max_steps``, else ``max_epochs`` x steps per epoch."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return trainer.max_steps - trainer.global_step
    batches = trainer.num_training_batches
    if trainer.max_epochs is None or trainer.max_epochs < 0 or batches in (None, float("inf")):
        return None
    per_epoch = -(-int(batches) // trainer.accumulate_grad_batches)  # ceil: a short last window still steps
    return trainer.max_epochs * per_epoch - trainer.global_step
