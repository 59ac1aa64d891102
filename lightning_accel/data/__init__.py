"""DataModules: built-in synthetic data, resumable loaders, and DALI pipelines (GPU or CPU backend)."""

from lightning_accel.data.resumable import ResumableDataLoader, ResumableSampler
from lightning_accel.data.synthetic import SyntheticClassificationDataModule, SyntheticTokenDataModule

__all__ = [
    "ResumableDataLoader",
    "ResumableSampler",
    "SyntheticClassificationDataModule",
    "SyntheticTokenDataModule",
]
