"""The one folder a run's files go to, derived one way for every callback that writes them (and where its data is read).

``goodput.json`` and ``goodput.png``, the progress file, profiler traces (``profile/``) and hang dumps (``hang/``)
all land in :func:`run_folder`: a ``GoodputMonitor(run_dir=...)`` given explicitly; else the
``PreemptionCheckpoint``'s folder (for a bucket URL its local staging folder, whose run files are uploaded beside the
checkpoints); else another checkpoint callback's ``dirpath``; else the logger's ``log_dir``; else the Trainer's
``default_root_dir``. So with the defaults they land in one tree, and ``lightning-accel doctor`` reads one folder.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Checkpoint

from lightning_accel.checkpoint import PreemptionCheckpoint
from lightning_accel.storage import is_remote, redact

__all__ = ["chosen_run_folder", "remote_data_source", "run_folder"]


def chosen_run_folder(trainer: Trainer) -> Path | None:
    """The run folder a user chose by saving or logging somewhere; ``None`` when the run saves and logs nothing."""
    for callback in trainer.callbacks:
        explicit = getattr(callback, "run_dir", None)  # GoodputMonitor(run_dir=...)
        if type(callback).__name__ == "GoodputMonitor" and explicit is not None:
            return Path(explicit)
    for callback in trainer.callbacks:  # only checkpoint writers: a TorchProfiler's dirpath holds traces
        if isinstance(callback, PreemptionCheckpoint):
            return callback.local_dir
    for callback in trainer.callbacks:
        if isinstance(callback, Checkpoint) and getattr(callback, "dirpath", None):
            return Path(callback.dirpath)  # type: ignore[attr-defined]
    if trainer.loggers:
        return Path(trainer.log_dir or trainer.default_root_dir)
    return None


def run_folder(trainer: Trainer) -> Path:
    """:func:`chosen_run_folder`, else the Trainer's ``default_root_dir``."""
    return chosen_run_folder(trainer) or Path(trainer.default_root_dir)


def remote_data_source(trainer: Trainer) -> str | None:
    """The object-store URL the DataModule reads from (a ``str`` attribute such as ``train_dir="s3://..."``), or
    ``None``: recorded beside the run's results so the doctor can name the fix for slow remote reads."""
    datamodule = getattr(trainer, "datamodule", None)
    for value in vars(datamodule).values() if datamodule is not None else ():
        if isinstance(value, str) and is_remote(value):
            return redact(value)
    return None
