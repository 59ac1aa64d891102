"""A DataLoader that remembers its position inside an epoch, so a mid-epoch resume continues exactly.

Lightning saves and restores the state of any train DataLoader that has ``state_dict``/``load_state_dict``
(see ``CombinedLoader._state_dicts``); a plain ``DataLoader`` has none, so after a mid-epoch resume it
would replay the epoch from its first batch. :class:`ResumableDataLoader` fills that gap without
torchdata: its sampler is a seeded :class:`~torch.utils.data.DistributedSampler` (Lightning keeps it
as-is under DDP and calls ``set_epoch`` on it) that deals one global order to the ranks a batch at a time, so the
position saved is a point in that order, and a resume on another number of ranks goes on from it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_accel.data.global_order import (
    LEGACY_ORDER_VERSION,
    ORDER_VERSION,
    DealtSlots,
    EpochOrder,
    check_order_version,
    slot_count,
    slots_per_rank,
)
from lightning_accel.data.seeding import PerSampleSeed, tag_epochs
from lightning_accel.data.worker_handoff import check_worker_handoff

__all__ = ["ResumableDataLoader", "ResumableSampler"]

log = logging.getLogger(__name__)

# Every batch drawn from the iterator has been trained on when a checkpoint is written: Lightning's
# `_PrefetchDataFetcher` only reads ahead for loaders without a length, and this one always has one.
# (tests/checkpoint/test_preemption.py::test_sigterm_mid_epoch_then_resume_is_bitwise_equal fails if that changes.)


class ResumableSampler(DistributedSampler):
    """Seeded sampler over one global order per epoch, dealt to the ranks a batch at a time, that can start its
    next epoch anywhere in that order.

    The epoch's order is a keyed permutation of the dataset seeded by ``seed`` and the epoch only, never by the number
    of ranks (:class:`~lightning_accel.data.global_order.EpochOrder`: computed per index in O(1) memory). It is cut
    into slots of ``batch_size`` samples, dealt round robin: rank ``r`` of ``W`` trains slots ``r``, ``r + W``,
    ``r + 2W``... So what a run has consumed is always a prefix of the global order, at any world size, and a run
    resumed on another number of ranks trains the rest of the epoch from where the saved one stopped, in the same
    batches (:meth:`start_next_epoch_at`).

    Every rank gets as many slots: when they do not deal evenly, the epoch's first slots are dealt again (as
    ``DistributedSampler`` pads), or with ``drop_last`` the last incomplete slot and the uneven rest are dropped.
    Works in a single process too: ``num_replicas`` and ``rank`` default to the process group's, read when an epoch
    starts (so a loader built before ``Trainer.fit`` shards right), else 1 and 0.
    """

    def __init__(
        self,
        dataset: Dataset,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        batch_size: int = 1,
    ) -> None:
        # Loaders are often built before Trainer.fit creates the process group: without an explicit
        # num_replicas/rank, they are read from the process group each time an epoch starts.
        self._from_process_group = num_replicas is None and rank is None
        super().__init__(
            dataset, num_replicas=num_replicas or 1, rank=rank or 0, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.batch_size = batch_size
        self.order_version = ORDER_VERSION  # a loader state from an earlier release sets the order it was made with
        self._start_slot = 0
        self._order: tuple[tuple[Any, ...], EpochOrder] | None = None  # the epoch's, by what it is made of
        self._follow_process_group()

    def _follow_process_group(self) -> None:
        if self._from_process_group and dist.is_available() and dist.is_initialized():
            self.num_replicas, self.rank = dist.get_world_size(), dist.get_rank()

    @property
    def world_size(self) -> int:
        """The number of ranks the slots are dealt to (the process group's, when not given)."""
        self._follow_process_group()
        return self.num_replicas

    def __len__(self) -> int:
        """Samples per rank in a whole epoch, counted in full slots (the loader's length is this over the batch)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        return slots_per_rank(n, self.batch_size, self.world_size, self.drop_last) * self.batch_size

    def epoch_order(self) -> EpochOrder:
        """This epoch's global order (position -> sample index)."""
        key = (len(self.dataset), self.seed, int(self.epoch), self.shuffle, self.order_version)  # type: ignore[arg-type]
        if self._order is None or self._order[0] != key:
            self._order = (key, EpochOrder(*key))
        return self._order[1]

    def global_slots(self) -> list[list[int]]:
        """This epoch's order cut into slots of ``batch_size`` (the last one short unless ``drop_last``). O(n): for
        inspection and tests; iterating the sampler never builds it."""
        order = self.epoch_order().as_list()
        slots = slot_count(len(order), self.batch_size, self.drop_last)
        return [order[i * self.batch_size : (i + 1) * self.batch_size] for i in range(slots)]

    def start_next_epoch_at(self, slot: int) -> None:
        """Make the next ``__iter__`` deal the global order from ``slot`` on (slots before it were trained)."""
        self._start_slot = slot

    def __iter__(self) -> Iterator[int]:
        start, self._start_slot = self._start_slot, 0
        n = len(self.dataset)  # type: ignore[arg-type]
        mine = DealtSlots(n, self.batch_size, self.drop_last, start, self.world_size, self.rank)
        return mine.indices(self.epoch_order())


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

    follows_world_size = True  # PreemptionCheckpoint resumes it on another number of ranks

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
            sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        elif not isinstance(sampler, ResumableSampler):
            raise TypeError(
                f"ResumableDataLoader needs a ResumableSampler, got {type(sampler).__name__}; "
                "pass shuffle/seed instead of a sampler"
            )
        # The sampler deals whole batches to the ranks, and drops what the loader would drop.
        sampler.batch_size, sampler.drop_last = batch_size, drop_last
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
        self._resume_at: dict[str, int] | None = None  # a loaded state, applied when the next epoch starts

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        check_worker_handoff("ResumableDataLoader", self.num_workers)  # before a worker starts: no silent wait
        world_size = self.sampler.world_size
        start = self._start_slot(world_size)
        self.sampler.start_next_epoch_at(start)
        self._yielded, self._exhausted = start // world_size, False
        if self._seed_generator:
            self.generator = torch.Generator().manual_seed(self._seed * 100_003 + int(self.sampler.epoch))
        return self._count(super().__iter__())

    def _start_slot(self, world_size: int) -> int:
        """The global slot this epoch starts at: 0, or where the loaded state left off, at any world size."""
        state, self._resume_at = self._resume_at, None
        if not state:
            return 0
        # Saved at an optimizer step: the slots consumed are batches x ranks of the run that saved.
        samples = (
            state["batches_consumed"] * state.get("world_size", world_size) * state.get("batch_size", self.batch_size)
        )
        if samples % self.batch_size or (samples // self.batch_size) % world_size:
            raise ValueError(
                f"ResumableDataLoader: the checkpoint's position ({samples} samples into epoch {state['epoch']}) is "
                f"not a whole number of batches of {self.batch_size} on each of {world_size} rank(s). Resume with the "
                f"batch size that saved ({state.get('batch_size', self.batch_size)}) on a number of ranks that divides "
                "the saved global batch (PreemptionCheckpoint checks this when the checkpoint loads)."
            )
        return samples // self.batch_size

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._yielded += 1
            yield batch
        self._exhausted = True

    def state_dict(self) -> dict[str, int]:
        """Where the next batch comes from: the epoch, the batches of it each rank has trained on, the world size and
        batch size that counted them (``batches_consumed x world_size`` slots of the global order are done), and the
        version of the order (:data:`~lightning_accel.data.global_order.ORDER_VERSION`).

        After the last batch of an epoch this points at the start of the next one.
        """
        epoch = int(self.sampler.epoch)
        sizes = {
            "world_size": self.sampler.world_size,
            "batch_size": int(self.batch_size),
            "order": self.sampler.order_version,  # which permutation the position is a point in
        }
        # At the epoch's last batch the iterator has not raised StopIteration yet, but nothing is left.
        if self._exhausted or self._yielded >= len(self):
            return {"epoch": epoch + 1, "batches_consumed": 0, **sizes}
        return {"epoch": epoch, "batches_consumed": self._yielded, **sizes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position, saved at this world size or another one.

        The sampler epoch is set here, not left to Lightning's ``set_epoch``: on resume Lightning
        creates the epoch's iterator before it sets the epoch, so the order would be epoch 0's.
        """
        missing = {"epoch", "batches_consumed"} - set(state)
        if missing:
            raise ValueError(f"ResumableDataLoader state is missing {sorted(missing)}: got {state}")
        self.sampler.set_epoch(int(state["epoch"]))
        self._resume_at = {key: int(value) for key, value in state.items()}
        # a state without one: the earlier release's; an unknown one is refused here, before training
        version = check_order_version(self._resume_at.get("order", LEGACY_ORDER_VERSION))
        if version != self.sampler.order_version:
            log.info(
                "ResumableDataLoader: the checkpoint's position is in the order of version %d (%s); this run keeps "
                "that order, so it resumes exactly",
                version,
                "torch.randperm per epoch" if version == LEGACY_ORDER_VERSION else "a keyed Feistel permutation",
            )
        self.sampler.order_version = version
