"""A DataLoader over a stream (an ``IterableDataset`` that keeps its position in ``state_dict``) that resumes exactly.

Lightning reads one batch ahead of a loader without a length (its fetcher must know whether the epoch has ended),
so when a checkpoint is written after batch k, batch k+1 has already been pulled from the stream. A loader that
saves the stream's state as it is then (torchdata's ``StatefulDataLoader`` does) resumes after batch k+1: one batch
is never trained on. :class:`ResumableStreamLoader` keeps the stream's state from before its latest pull and saves
that one, so the resumed run starts at batch k+1.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.data import has_len
from torch.utils.data import DataLoader, IterableDataset

from lightning_accel.ranks import current_rank, for_rank, gather_from_ranks


def is_resumable_stream(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


class ResumableStreamLoader(DataLoader):
    """``DataLoader`` over a stateful ``IterableDataset`` whose position is saved in Lightning checkpoints, the batch
    Lightning has read ahead accounted for. Each rank saves its own stream's state (streams are sharded by the
    dataset itself) and gets it back on resume.

    Args:
        dataset: An ``IterableDataset`` with ``state_dict()`` (its position, a plain picklable value) and
            ``load_state_dict(state)`` (its next ``__iter__`` continues from there).
        batch_size: Samples per batch.
        **kwargs: Passed to :class:`~torch.utils.data.DataLoader`; ``num_workers`` must be 0 (a worker's copy of
            the stream keeps a position the main process cannot read: use torchdata's ``StatefulDataLoader`` and
            accept the read-ahead batch, or decode in the main process).
    """

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
                f"ResumableStreamLoader needs num_workers=0, got {kwargs['num_workers']}: a worker's copy of the "
                "stream keeps a position this process cannot read. Decode in the main process, or use torchdata's "
                "StatefulDataLoader (it saves the workers' states, but skips the batch Lightning reads ahead)"
            )
        super().__init__(dataset, batch_size=batch_size, **kwargs)
        self._before_pull: Any = None  # the stream's state right before the latest batch was pulled

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._tracked(super().__iter__())

    def _tracked(self, batches: Iterator[Any]) -> Iterator[Any]:
        self._before_pull = None
        while True:
            self._before_pull = copy.deepcopy(self.dataset.state_dict())  # type: ignore[attr-defined]
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    def _untrained_read_ahead(self) -> bool:
        # Lightning reads ahead only when the loader has no length (tests/data/test_stream.py pins it)
        return self._before_pull is not None and not has_len(self)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's stream position before its last pulled batch (a collective: every rank must call it)."""
        stream = self.dataset
        own = self._before_pull if self._untrained_read_ahead() else stream.state_dict()  # type: ignore[attr-defined]
        return {"streams": gather_from_ranks(copy.deepcopy(own))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "streams" not in state:
            raise ValueError(f"ResumableStreamLoader state is missing 'streams': got {sorted(state)}")
        self.dataset.load_state_dict(for_rank(state["streams"], current_rank()))  # type: ignore[attr-defined]
