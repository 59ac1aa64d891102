"""Random augmentation that resumes exactly in loader workers: every sample's draws seeded by (seed, epoch, index).

A worker's random state is its own and is not in any checkpoint, and after a mid-epoch resume the batches go to
other workers than before; so augmentation drawn in ``__getitem__`` from the global generators differs after a
resume. :class:`PerSampleSeed` seeds Python's, NumPy's and torch's generators from the sample's own
(seed, epoch, index) before each ``__getitem__``: the same draws whichever worker or rank loads it and wherever
the run was cut. The epoch comes with the index from the sampler (:func:`tag_epochs`), since a worker's copy of the
dataset does not see the epoch change.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, get_worker_info

from lightning_accel.contracts import is_stateful

__all__ = ["PerSampleSeed", "sample_seed", "tag_epochs"]

_MASK = (1 << 64) - 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch (splitmix64 over the three; neighbouring samples far apart)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


class PerSampleSeed(Dataset):
    """Wraps a map-style dataset: each ``dataset[(epoch, index)]`` runs ``dataset[index]`` with the global
    generators seeded by :func:`sample_seed` (in the main process they are put back afterwards, so the training
    step's draws are untouched). Serve it with a sampler from :func:`tag_epochs`.
    """

    seeds_per_sample = True  # what PreemptionCheckpoint looks for before warning about worker augmentation

    def __init__(self, dataset: Dataset, seed: int = 0) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        if not isinstance(key, tuple):
            raise TypeError(
                f"PerSampleSeed got the index {key!r} without its epoch: serve it with a sampler from "
                "lightning_accel.data.tag_epochs(sampler) (ResumableDataLoader does this itself)"
            )
        epoch, index = key
        seed = sample_seed(self.seed, epoch, index)
        if get_worker_info() is not None:  # a worker's generators are its own
            _seed_all(seed)
            return self.dataset[index]
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            _seed_all(seed)
            return self.dataset[index]
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    # the CPU generator only: torch.manual_seed also visits every accelerator's, at 100x the cost per sample, and a
    # loader's __getitem__ draws on the CPU
    torch.default_generator.manual_seed(seed)


def _epoch_tagged(cls: type) -> type:
    """A subclass of the sampler class ``cls`` whose indices come as ``(epoch, index)``; it adds nothing to the
    instance's layout, so an instance of ``cls`` can take it."""

    def __iter__(self: Any) -> Any:
        # the epoch is read as the indices come: a stateful sampler may set it when its iteration starts
        for index in cls.__iter__(self):
            yield int(self.epoch), index

    def state_dict(self: Any) -> dict[str, Any]:
        # The epoch too: a StatefulDataLoader with workers draws its first indices when its iterator is created,
        # before Lightning calls set_epoch on resume, and torchdata's own sampler state has no epoch.
        return {**cls.state_dict(self), "epoch": int(self.epoch)}

    def load_state_dict(self: Any, state: dict[str, Any]) -> None:
        state = dict(state)
        if "epoch" in state:
            self.set_epoch(state.pop("epoch"))
        cls.load_state_dict(self, state)

    methods: dict[str, Any] = {"__slots__": (), "__iter__": __iter__, "epoch_tagged": True}
    if is_stateful(cls):
        methods.update(state_dict=state_dict, load_state_dict=load_state_dict)
    return type(f"EpochTagged{cls.__name__}", (cls,), methods)


_TAGGED: dict[type, type] = {}


def tag_epochs(sampler: Sampler) -> Sampler:
    """Make ``sampler`` yield ``(epoch, index)`` pairs for :class:`PerSampleSeed`, in place: it stays an instance of
    its own class (Lightning keeps a ``DistributedSampler`` as it is, ``StatefulDataLoader`` saves its state, now
    with the epoch in it), and its epoch is the one ``set_epoch`` gave it. It needs an ``epoch``
    (``DistributedSampler``, torchdata's ``StatefulDistributedSampler``): a sampler without one would give every
    epoch the same draws."""
    if not hasattr(sampler, "epoch") or not callable(getattr(sampler, "set_epoch", None)):
        raise TypeError(
            f"tag_epochs needs a sampler that knows its epoch (set_epoch and epoch), got {type(sampler).__name__}; "
            "use torchdata's StatefulDistributedSampler (num_replicas=1, rank=0 on one process) or "
            "lightning_accel.ResumableDataLoader"
        )
    cls = type(sampler)
    if not getattr(cls, "epoch_tagged", False):
        if cls not in _TAGGED:
            _TAGGED[cls] = _epoch_tagged(cls)
        sampler.__class__ = _TAGGED[cls]
    return sampler
