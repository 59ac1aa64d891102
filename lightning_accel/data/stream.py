"""A DataLoader over a stream (an ``IterableDataset`` that keeps its position in ``state_dict``) that resumes exactly.

Lightning reads one batch ahead of a loader without a length (its fetcher must know whether the epoch has ended),
so when a checkpoint is written after batch k, batch k+1 has already been pulled from the stream. A loader that
saves the stream's state as it is then (torchdata's ``StatefulDataLoader`` does) resumes after batch k+1: one batch
is never trained on. :class:`ResumableStreamLoader` (a ``StatefulDataLoader``) keeps the loader's state from before
its latest pull and saves that one, so the resumed run starts at batch k+1.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.data import has_len
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_accel.ranks import current_rank, for_rank, gather_from_ranks


def is_resumable_stream(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


class ResumableStreamLoader(StatefulDataLoader):
    """torchdata's ``StatefulDataLoader`` over a stateful ``IterableDataset``, the batch Lightning has read ahead
    accounted for: the state saved is the one from before the latest pull. Each rank saves its own stream's state
    (streams are sharded by the dataset itself, per rank and per worker) and gets it back on resume.

    Args:
        dataset: An ``IterableDataset`` with ``state_dict()`` (its position, a plain picklable value) and
            ``load_state_dict(state)`` (its next ``__iter__`` continues from there).
        batch_size: Samples per batch.
        **kwargs: Passed to ``StatefulDataLoader`` (``pin_memory`` ...). ``num_workers`` must be 0: with
            workers, a stream resumed near an epoch's end trains part of the next epoch twice (tests/data/
            test_stream.py measures it).
    """

    accounts_for_read_ahead = True  # what PreemptionCheckpoint looks for before warning about a skipped batch

    def __init__(self, dataset: IterableDataset, batch_size: int = 1, **kwargs: Any) -> None:
        if not isinstance(dataset, IterableDataset):
            raise TypeError(
                f"ResumableStreamLoader takes an IterableDataset, got {type(dataset).__name__}; for a map-style "
                "dataset use lightning_accel.ResumableDataLoader"
            )
        if not is_resumable_stream(dataset):
            raise TypeError(
                f"{type(dataset).__name__} has no state_dict()/load_state_dict(), so its position cannot be saved: "
                "add both (state_dict returns where the stream is, load_state_dict makes the next __iter__ "
                "continue from there)"
            )
        if kwargs.get("num_workers", 0):
            raise ValueError(
                f"ResumableStreamLoader needs num_workers=0, got {kwargs['num_workers']}: with workers, a stream "
                "resumed from a checkpoint near an epoch's end trains part of the next epoch twice (measured with "
                "torchdata's StatefulDataLoader, which this loader is). Decode in the main process, or accept that"
            )
        if kwargs.setdefault("snapshot_every_n_steps", 1) != 1:
            raise ValueError(
                f"ResumableStreamLoader snapshots its workers after every batch, got snapshot_every_n_steps="
                f"{kwargs['snapshot_every_n_steps']}: any batch may be the one a checkpoint is written after"
            )
        super().__init__(dataset, batch_size=batch_size, **kwargs)
        self._before_pull: Any = None  # the loader's state right before the latest batch was pulled

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._tracked(super().__iter__())

    def _tracked(self, batches: Iterator[Any]) -> Iterator[Any]:
        while True:
            self._before_pull = copy.deepcopy(super().state_dict())
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    def _untrained_read_ahead(self) -> bool:
        # Lightning reads ahead only when the loader has no length (tests/data/test_stream.py pins it)
        return self._before_pull is not None and not has_len(self)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's loader state before its last pulled batch (a collective: every rank must call it)."""
        own = self._before_pull if self._untrained_read_ahead() else super().state_dict()
        return {"streams": gather_from_ranks(copy.deepcopy(own))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "streams" not in state:
            raise ValueError(f"ResumableStreamLoader state is missing 'streams': got {sorted(state)}")
        super().load_state_dict(for_rank(state["streams"], current_rank()))
