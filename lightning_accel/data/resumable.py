"""A DataLoader that remembers its position inside an epoch, so a mid-epoch resume continues exactly.

Lightning saves and restores the state of any train DataLoader that has ``state_dict``/``load_state_dict``
(see ``CombinedLoader._state_dicts``); a plain ``DataLoader`` has none, so after a mid-epoch resume it
would replay the epoch from its first batch. :class:`ResumableDataLoader` fills that gap without
torchdata: its sampler is a seeded :class:`~torch.utils.data.DistributedSampler` (Lightning keeps it
as-is under DDP and calls ``set_epoch`` on it) that can skip the samples already consumed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_accel.data.seeding import PerSampleSeed, tag_epochs

# Every batch drawn from the iterator has been trained on when a checkpoint is written: Lightning's
# `_PrefetchDataFetcher` only reads ahead for loaders without a length, and this one always has one.
# (The bitwise resume test in tests/test_checkpoint.py fails if that ever changes.)


class ResumableSampler(DistributedSampler):
    """Seeded, rank-sharded sampler that can skip the first ``n`` samples of its next epoch.

    Works in a single process too: ``num_replicas`` and ``rank`` default to the process group's, read
    when an epoch starts (so a loader built before ``Trainer.fit`` shards right), else 1 and 0. The
    order depends only on ``seed`` and the epoch, never on global RNG state.
    """

    def __init__(
        self,
        dataset: Dataset,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        # Loaders are often built before Trainer.fit creates the process group: without an explicit
        # num_replicas/rank, they are read from the process group each time an epoch starts.
        self._from_process_group = num_replicas is None and rank is None
        super().__init__(
            dataset, num_replicas=num_replicas or 1, rank=rank or 0, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self._skip = 0
        self._follow_process_group()

    def _follow_process_group(self) -> None:
        if not (self._from_process_group and dist.is_available() and dist.is_initialized()):
            return
        replicas, rank = dist.get_world_size(), dist.get_rank()
        if (replicas, rank) == (self.num_replicas, self.rank):
            return
        self.num_replicas, self.rank = replicas, rank
        n = len(self.dataset)  # type: ignore[arg-type]
        # DistributedSampler's own sizing, redone for the new world size.
        self.num_samples = (
            math.ceil((n - replicas) / replicas) if self.drop_last and n % replicas else math.ceil(n / replicas)
        )
        self.total_size = self.num_samples * replicas

    def __len__(self) -> int:
        self._follow_process_group()
        return super().__len__()

    def skip_next_epoch_start(self, num_samples: int) -> None:
        """Make the next ``__iter__`` start ``num_samples`` into this rank's order."""
        self._skip = num_samples

    def __iter__(self) -> Iterator[int]:
        self._follow_process_group()
        indices = list(super().__iter__())
        skip, self._skip = self._skip, 0
        return iter(indices[skip:])


class ResumableDataLoader(DataLoader):
    """``DataLoader`` whose in-epoch position is saved in Lightning checkpoints and restored on resume.

    Args:
        dataset: Map-style dataset.
        batch_size: Samples per batch.
        shuffle: Shuffle with a permutation seeded by ``seed`` and the epoch.
        seed: Seed of the shuffle order.
        drop_last: Drop the last incomplete batch of each rank.
        per_sample_seed: Seed the random draws of every sample's ``__getitem__`` from (``seed``, epoch, index)
            (:class:`~lightning_accel.data.seeding.PerSampleSeed`), so augmentation resumes exactly, in loader
            workers or not (a resumed loader fetches its first batch before the checkpoint's RNG state is back).
            ``False`` for a dataset that draws nothing, to save the few microseconds per sample.
        **kwargs: Passed to :class:`~torch.utils.data.DataLoader` (``num_workers``, ``pin_memory`` ...).
            ``sampler`` may be given only as a :class:`ResumableSampler`.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        per_sample_seed: bool = True,
        **kwargs: Any,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                f"ResumableDataLoader takes a map-style dataset (__len__ and __getitem__), got the stream "
                f"{type(dataset).__name__}: use lightning_accel.ResumableStreamLoader for an IterableDataset that "
                "keeps its position in state_dict()/load_state_dict() (docs/checkpointing.md, 'Streams')"
            )
        sampler = kwargs.pop("sampler", None)
        if sampler is None:
            sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed)
        elif not isinstance(sampler, ResumableSampler):
            raise TypeError(
                f"ResumableDataLoader needs a ResumableSampler, got {type(sampler).__name__}; "
                "pass shuffle/seed instead of a sampler"
            )
        if per_sample_seed:
            dataset, sampler = PerSampleSeed(dataset, seed), tag_epochs(sampler)
        self.per_sample_seed = per_sample_seed
        # Without a generator of its own, every new iterator draws its workers' base seed from the global
        # torch RNG; seeding one per epoch keeps the global RNG untouched, so an epoch-end resume sees
        # the same global RNG stream as the uninterrupted run.
        self._seed_generator = kwargs.get("generator") is None
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)
        self._seed = seed
        self._yielded = 0
        self._exhausted = False
        self._resume_at = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        start, self._resume_at = self._resume_at, 0
        if start:
            self.sampler.skip_next_epoch_start(start * self.batch_size)
        self._yielded, self._exhausted = start, False
        if self._seed_generator:
            self.generator = torch.Generator().manual_seed(self._seed * 100_003 + int(self.sampler.epoch))
        return self._count(super().__iter__())

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._yielded += 1
            yield batch
        self._exhausted = True

    def state_dict(self) -> dict[str, int]:
        """Where the next batch comes from: epoch, and batches of it already trained on.

        After the last batch of an epoch this points at the start of the next one.
        """
        epoch = int(self.sampler.epoch)
        # At the epoch's last batch the iterator has not raised StopIteration yet, but nothing is left.
        if self._exhausted or self._yielded >= len(self):
            return {"epoch": epoch + 1, "batches_consumed": 0}
        return {"epoch": epoch, "batches_consumed": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position.

        The sampler epoch is set here, not left to Lightning's ``set_epoch``: on resume Lightning
        creates the epoch's iterator before it sets the epoch, so the order would be epoch 0's.
        """
        missing = {"epoch", "batches_consumed"} - set(state)
        if missing:
            raise ValueError(f"ResumableDataLoader state is missing {sorted(missing)}: got {state}")
        self.sampler.set_epoch(int(state["epoch"]))
        self._resume_at = int(state["batches_consumed"])
