"""Data: resumable loaders and samplers, exact per-sample augmentation, and DALI pipelines (GPU or CPU backend).

The DALI names are imported on first use: DALI is large and slow to import, and a run that does not use it (or a
machine without DALI) should not pay for it. The synthetic demo DataModules are in :mod:`lightning_accel.demos`.
"""

from typing import Any

from lightning_accel.data.resumable import ResumableDataLoader, ResumableSampler
from lightning_accel.data.seeding import PerSampleSeed, tag_epochs
from lightning_accel.data.stream import ResumableStreamLoader
from lightning_accel.extras import require

_DALI_NAMES = {"DALIImageDataModule", "DALILoader", "find_unreadable_images", "scan_image_folder"}

__all__ = [
    "DALIImageDataModule",
    "DALILoader",
    "PerSampleSeed",
    "ResumableDataLoader",
    "ResumableSampler",
    "ResumableStreamLoader",
    "find_unreadable_images",
    "scan_image_folder",
    "tag_epochs",
]


def __getattr__(name: str) -> Any:
    if name in _DALI_NAMES:
        require("dali", f"lightning_accel.data.{name}")  # before DALI's import fails deep inside ours
        from lightning_accel.data import dali, dali_loader

        value = getattr(dali_loader, name, None) or getattr(dali, name)
        globals()[name] = value  # found here from now on: no second check or lookup
        return value
    raise AttributeError(f"module 'lightning_accel.data' has no attribute {name!r}")
