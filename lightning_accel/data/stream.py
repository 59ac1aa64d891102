"""A DataLoader over a stream (an ``IterableDataset`` that keeps its position in ``state_dict``) that resumes exactly.

Lightning reads one batch ahead of a loader without a length (its fetcher must know whether the epoch has ended),
so when a checkpoint is written after batch k, batch k+1 has already been pulled from the stream. A loader that
saves the stream's state as it is then (torchdata's ``StatefulDataLoader`` does) resumes after batch k+1: one batch
is never trained on. :class:`ResumableStreamLoader` (a ``StatefulDataLoader``) keeps the loader's state from before
its latest pull and saves that one, so the resumed run starts at batch k+1.

With loader workers, each worker holds its own copy of the stream (its shard), and a worker whose shard ended
before the checkpoint must stay ended on resume. A stream that starts over once it ends (the usual way to begin the
next epoch) saves the same state at its end as at its start, and torchdata restarts every restored worker at least
once, so that shard would be trained twice. The loader therefore wraps the stream in :class:`_EndAwareStream`,
whose state says whether the shard had ended.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.data import has_len
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_accel.contracts import is_stateful
from lightning_accel.data.worker_handoff import check_worker_handoff
from lightning_accel.ranks import current_rank, for_rank, gather_from_ranks

__all__ = ["ResumableStreamLoader"]


class _EndAwareStream(IterableDataset):
    """The user's stream plus whether its iteration had ended: restored as ended, the next ``__iter__`` yields
    nothing (the shard is done for this epoch) and the one after that is the stream's own next epoch."""

    def __init__(self, stream: IterableDataset) -> None:
        self.stream = stream
        self.ended = False
        self._skip_next_iter = False

    def __iter__(self) -> Iterator[Any]:
        if self._skip_next_iter:
            self._skip_next_iter = False
            return
        self.ended = False
        yield from self.stream
        self.ended = True

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "ended": self.ended}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.ended = self._skip_next_iter = bool(state["ended"])


class ResumableStreamLoader(StatefulDataLoader):
    """torchdata's ``StatefulDataLoader`` over a stateful ``IterableDataset``, the batch Lightning has read ahead
    accounted for: the state saved is the one from before the latest pull. Each rank saves its own stream's state
    (streams are sharded by the dataset itself, per rank and per worker) and gets it back on resume.

    Args:
        dataset: An ``IterableDataset`` with ``state_dict()`` (its position, a plain picklable value) and
            ``load_state_dict(state)`` (its next ``__iter__`` continues from there).
        batch_size: Samples per batch.
        **kwargs: Passed to ``StatefulDataLoader`` (``num_workers``, ``pin_memory`` ...). With workers each
            worker iterates its own copy of the stream; the stream shards itself by ``get_worker_info()``.

    ``loader.dataset`` is a wrapper that records whether each shard had ended; the user's stream is
    ``loader.stream``.
    """

    accounts_for_read_ahead = True  # what PreemptionCheckpoint looks for before warning about a skipped batch

    def __init__(self, dataset: IterableDataset, batch_size: int = 1, **kwargs: Any) -> None:
        if not isinstance(dataset, IterableDataset):
            raise TypeError(
                f"ResumableStreamLoader takes an IterableDataset, got {type(dataset).__name__}; for a map-style "
                "dataset use lightning_accel.ResumableDataLoader"
            )
        if not is_stateful(dataset):
            raise TypeError(
                f"{type(dataset).__name__} has no state_dict()/load_state_dict(), so its position cannot be saved: "
                "add both (state_dict returns where the stream is, load_state_dict makes the next __iter__ "
                "continue from there)"
            )
        if kwargs.setdefault("snapshot_every_n_steps", 1) != 1:
            raise ValueError(
                f"ResumableStreamLoader snapshots its workers after every batch, got snapshot_every_n_steps="
                f"{kwargs['snapshot_every_n_steps']}: any batch may be the one a checkpoint is written after"
            )
        super().__init__(_EndAwareStream(dataset), batch_size=batch_size, **kwargs)
        self.stream = dataset
        self._before_pull: Any = None  # the loader's state right before the latest batch was pulled

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        check_worker_handoff("ResumableStreamLoader", self.num_workers)  # before a worker starts: no silent wait
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
