"""Random augmentation in loader workers resumes exactly: each sample's draws are seeded by (seed, epoch, index),
whichever worker loads it and wherever the run was cut; for ResumableDataLoader and StatefulDataLoader alike."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_accel import PreemptionCheckpoint, ResumableDataLoader, find_resume_checkpoint
from lightning_accel.checkpoint import Preempted
from lightning_accel.data import PerSampleSeed, tag_epochs
from lightning_accel.data.seeding import sample_seed
from tests.conftest import SigtermAt, tiny_trainer_kwargs


class Augmented(Dataset):
    """48 samples; __getitem__ draws noise from torch, a flip from Python's random and a scale from NumPy."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(48, 8, generator=g), torch.randint(0, 2, (48,), generator=g)

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        x = self.x[i] + 0.1 * torch.randn(8)
        if random.random() < 0.5:
            x = x.flip(0)
        return x * float(np.random.uniform(0.9, 1.1)), self.y[i], i


class Net(LightningModule):
    """BatchNorm and Dropout; records each trained sample's id and its augmented values."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.2), nn.Linear(16, 2))
        self.seen: list[tuple[int, float]] = []

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self.seen += [(int(i), float(v)) for i, v in zip(ids, x.sum(1), strict=True)]
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(kind: str, workers: int):
    if kind == "resumable":
        return ResumableDataLoader(Augmented(), batch_size=4, shuffle=True, seed=0, num_workers=workers)
    if kind == "plain":  # torchdata's own sampler, as its docs show it: not seeded per sample, no epoch in its state
        data = Augmented()
        sampler = StatefulDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        return StatefulDataLoader(data, batch_size=4, sampler=sampler, num_workers=workers)
    dataset = PerSampleSeed(Augmented(), seed=0)
    sampler = tag_epochs(StatefulDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0))
    return StatefulDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers)


def fit(root: Path, kind: str, workers: int, stop_at: int | None = None, ckpt_path: str | None = None) -> Net:
    torch.manual_seed(0)
    model = Net()
    callbacks = [PreemptionCheckpoint(root / "ck"), *([SigtermAt(stop_at)] if stop_at is not None else [])]
    trainer = Trainer(**tiny_trainer_kwargs(root, max_epochs=2, callbacks=callbacks))
    with warnings.catch_warnings():
        if kind != "plain":  # seeded per sample: no warning about the workers' random state
            warnings.filterwarnings("error", message=".*worker processes. Their random state")
        try:
            trainer.fit(model, loader(kind, workers), ckpt_path=ckpt_path)
        except Preempted:
            pass
    return model


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["resumable", "stateful"])
@pytest.mark.parametrize("workers", [0, 2])
def test_augmented_samples_after_a_resume_equal_the_uninterrupted_runs(tmp_path, kind, workers):
    whole = fit(tmp_path / "whole", kind, workers)
    assert sorted(i for i, _ in whole.seen) == sorted(list(range(48)) * 2)
    for stop_at in (5, 17):  # mid-epoch in each of the two epochs (12 batches an epoch)
        cut = tmp_path / f"cut{stop_at}"
        first = fit(cut, kind, workers, stop_at=stop_at)
        resumed = fit(cut, kind, workers, ckpt_path=find_resume_checkpoint(cut / "ck"))
        assert first.seen + resumed.seen == whole.seen, stop_at  # same samples, same draws, same order
        for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
            assert torch.equal(a, b)


def test_draws_depend_on_the_sample_and_epoch_only_and_leave_training_alone():
    data = PerSampleSeed(Augmented(), seed=3)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = data[(1, 7)], data[(1, 7)]
    assert torch.equal(a[0], b[0]) and not torch.equal(data[(2, 7)][0], a[0])  # another epoch: other draws
    assert torch.equal(torch.get_rng_state(), before)  # on the main process the generators are put back
    assert len({sample_seed(0, e, i) for e in range(4) for i in range(1000)}) == 4000
    with pytest.raises(TypeError, match="without its epoch"):
        data[7]
    with pytest.raises(TypeError, match="needs a sampler that knows its epoch"):
        tag_epochs(torch.utils.data.RandomSampler(range(4)))
    sampler = tag_epochs(StatefulDistributedSampler(range(4), num_replicas=1, rank=0, shuffle=False))
    sampler.set_epoch(3)
    assert isinstance(sampler, StatefulDistributedSampler) and list(sampler) == [(3, i) for i in range(4)]


@pytest.mark.multiprocess
def test_statefuldataloader_with_workers_loses_the_epoch_on_resume_and_says_so(tmp_path):
    """Measured: torchdata's StatefulDistributedSampler keeps no epoch, and with workers the resumed iterator takes
    its indices before Lightning sets it, so a resume in epoch 1 trains epoch 0's order. The run warns, naming
    tag_epochs(); with it (the test above) the order and the draws are exact."""
    whole = [i for i, _ in fit(tmp_path / "whole", "plain", 2).seen]
    first = fit(tmp_path / "cut", "plain", 2, stop_at=17)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resumed = fit(tmp_path / "cut", "plain", 2, ckpt_path=find_resume_checkpoint(tmp_path / "cut" / "ck"))
    assert any("the rest of the epoch comes in epoch 0's order" in str(w.message) for w in record)
    assert [i for i, _ in first.seen + resumed.seen] != whole  # what the warning says
