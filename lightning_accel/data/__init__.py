"""DataModules: built-in synthetic data, resumable loaders, and DALI pipelines (GPU or CPU backend)."""

from lightning_accel.data.dali import DALIImageDataModule, DALILoader, find_unreadable_images, scan_image_folder
from lightning_accel.data.resumable import ResumableDataLoader, ResumableSampler
from lightning_accel.data.synthetic import SyntheticClassificationDataModule, SyntheticTokenDataModule

__all__ = [
    "DALIImageDataModule",
    "DALILoader",
    "find_unreadable_images",
    "scan_image_folder",
    "ResumableDataLoader",
    "ResumableSampler",
    "SyntheticClassificationDataModule",
    "SyntheticTokenDataModule",
]
