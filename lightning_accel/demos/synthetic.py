"""Built-in synthetic DataModules: learnable, seeded, no download, resumable mid-epoch."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_accel.data.resumable import ResumableDataLoader

__all__ = ["SyntheticClassificationDataModule", "SyntheticTokenDataModule"]


class _TensorDataModule(LightningDataModule):
    """Shared loader plumbing: subclasses fill ``self.train_set`` / ``self.val_set`` in ``setup``."""

    def __init__(
        self, batch_size: int, num_workers: int, seed: int, pin_memory: bool = False, persistent_workers: bool = False
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        # read by the loaders at each call, so `tune` (and Lightning's BatchSizeFinder) can change them
        self.pin_memory, self.persistent_workers = pin_memory, persistent_workers
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def _loader_kwargs(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers and self.num_workers > 0,
        }

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        if self.train_set is None:
            raise RuntimeError(f"{type(self).__name__}.train_dataloader() before setup(): call dm.setup('fit') first")
        # tensors drawn once at setup: __getitem__ draws nothing, so no per-sample seeding to pay for
        loader_kwargs = {"per_sample_seed": False, **self._loader_kwargs()}
        return ResumableDataLoader(self.train_set, shuffle=True, seed=self.seed, **loader_kwargs)

    @override
    def val_dataloader(self) -> DataLoader:
        if self.val_set is None:
            raise RuntimeError(f"{type(self).__name__}.val_dataloader() before setup(): call dm.setup('fit') first")
        return DataLoader(self.val_set, **self._loader_kwargs())


class SyntheticClassificationDataModule(_TensorDataModule):
    """Gaussian features labelled by a fixed random linear teacher, so an MLP can learn them.

    Args:
        num_samples: Training samples.
        val_samples: Validation samples.
        input_dim: Features per sample.
        num_classes: Number of classes.
        batch_size: Samples per batch.
        num_workers: DataLoader workers.
        seed: Seed for the data and the shuffle order.
        pin_memory / persistent_workers: DataLoader settings (persistent only with workers).
    """

    def __init__(
        self,
        num_samples: int = 2048,
        val_samples: int = 256,
        input_dim: int = 32,
        num_classes: int = 4,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
    ) -> None:
        super().__init__(batch_size, num_workers, seed, pin_memory, persistent_workers)
        self.num_samples, self.val_samples = num_samples, val_samples
        self.input_dim, self.num_classes = input_dim, num_classes

    @override
    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(self.seed)
        teacher = torch.randn(self.input_dim, self.num_classes, generator=g)
        x = torch.randn(self.num_samples + self.val_samples, self.input_dim, generator=g)
        y = (x @ teacher).argmax(dim=1)
        n = self.num_samples
        self.train_set = TensorDataset(x[:n], y[:n])
        self.val_set = TensorDataset(x[n:], y[n:])


class SyntheticTokenDataModule(_TensorDataModule):
    """Token sequences that follow ``t[i+1] = (a * t[i] + c) % vocab_size`` from a random start.

    A language model can drive the loss towards zero, which makes a working training loop visible.
    Each sample is ``(inputs, targets)`` with ``targets`` shifted by one token.

    Args:
        num_samples: Training sequences.
        val_samples: Validation sequences.
        seq_len: Tokens per input sequence.
        vocab_size: Number of token ids.
        batch_size: Sequences per batch.
        num_workers: DataLoader workers.
        seed: Seed for the data and the shuffle order.
        pin_memory / persistent_workers: DataLoader settings (persistent only with workers).
    """

    def __init__(
        self,
        num_samples: int = 1024,
        val_samples: int = 128,
        seq_len: int = 64,
        vocab_size: int = 256,
        batch_size: int = 16,
        num_workers: int = 0,
        seed: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
    ) -> None:
        super().__init__(batch_size, num_workers, seed, pin_memory, persistent_workers)
        self.num_samples, self.val_samples = num_samples, val_samples
        self.seq_len, self.vocab_size = seq_len, vocab_size

    @override
    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(self.seed)
        total = self.num_samples + self.val_samples
        start = torch.randint(0, self.vocab_size, (total, 1), generator=g)
        steps = torch.arange(self.seq_len + 1)
        # Closed form of the affine recurrence would overflow; iterate instead (seq_len is small).
        tokens = [start]
        for _ in steps[1:]:
            tokens.append((5 * tokens[-1] + 3) % self.vocab_size)
        seq = torch.cat(tokens, dim=1)
        inputs, targets = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        n = self.num_samples
        self.train_set = TensorDataset(inputs[:n], targets[:n])
        self.val_set = TensorDataset(inputs[n:], targets[n:])
