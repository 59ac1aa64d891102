"""Streams (IterableDataset) resume exactly through ResumableStreamLoader: no sample skipped or repeated, though
Lightning reads a batch ahead; the loaders that cannot say so at run time."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_accel import PreemptionCheckpoint, ResumableDataLoader, ResumableStreamLoader, find_resume_checkpoint
from lightning_accel.checkpoint import Preempted
from tests.checkpoint.test_curves import SigtermAt
from tests.conftest import tiny_trainer_kwargs


class Stream(IterableDataset):
    """A stream of 60 samples an epoch, its position in state_dict(); each sample carries its id and a random flip
    drawn from a generator seeded by the id (augmentation that does not depend on where the run was cut). In loader
    workers each takes every n-th sample (its shard), its position its own."""

    def __init__(self, n: int = 60) -> None:
        self.n, self.pos = n, 0
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g)

    def __iter__(self):
        info = get_worker_info()
        shard, shards = (info.id, info.num_workers) if info is not None else (0, 1)
        while self.pos < self.n:
            i = self.pos
            self.pos += 1
            if i % shards != shard:
                continue
            flip = torch.rand((), generator=torch.Generator().manual_seed(i)) < 0.5
            yield (-self.x[i] if flip else self.x[i]), self.y[i], i
        self.pos = 0  # the next epoch starts over

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class Net(LightningModule):
    """BatchNorm and Dropout; records every sample id it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.2), nn.Linear(16, 2))
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self.seen += ids.tolist()
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(root: Path, loader_class: type, stop_at: int | None = None, ckpt_path: str | None = None) -> Net:
    torch.manual_seed(0)
    model = Net()
    callbacks = [PreemptionCheckpoint(root / "ck"), *([SigtermAt(stop_at)] if stop_at is not None else [])]
    trainer = Trainer(**tiny_trainer_kwargs(root, max_epochs=2, callbacks=callbacks))
    try:
        trainer.fit(model, loader_class(Stream(), batch_size=4), ckpt_path=ckpt_path)
    except Preempted:
        pass
    return model


# mid-epoch; the epoch's last batch (the save moves to the next epoch's first step); in the second epoch
@pytest.mark.parametrize("stop_at", [3, 14, 20])
def test_a_stream_resumes_with_no_sample_skipped_or_repeated(tmp_path, stop_at):
    whole = fit(tmp_path / "whole", ResumableStreamLoader)
    assert whole.seen == list(range(60)) * 2
    first = fit(tmp_path / "cut", ResumableStreamLoader, stop_at=stop_at)
    resumed = fit(tmp_path / "cut", ResumableStreamLoader, ckpt_path=find_resume_checkpoint(tmp_path / "cut" / "ck"))
    assert first.seen + resumed.seen == whole.seen  # the batch Lightning read ahead is trained after the resume
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_stateful_dataloader_over_a_stream_skips_the_read_ahead_batch_and_says_so(tmp_path):
    whole = fit(tmp_path / "whole", StatefulDataLoader)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = fit(tmp_path / "cut", StatefulDataLoader, stop_at=3)
    assert any("a resume skips one batch" in str(w.message) for w in record)
    resumed = fit(tmp_path / "cut", StatefulDataLoader, ckpt_path=find_resume_checkpoint(tmp_path / "cut" / "ck"))
    assert len(first.seen + resumed.seen) == len(whole.seen) - 4  # what the warning says: one batch of 4 skipped


def test_loaders_that_cannot_resume_a_stream_say_what_to_use(tmp_path):
    with pytest.raises(TypeError, match=r"use lightning_accel\.ResumableStreamLoader for an IterableDataset"):
        ResumableDataLoader(Stream(), batch_size=4)
    with pytest.raises(ValueError, match="needs num_workers=0, got 2"):
        ResumableStreamLoader(Stream(), num_workers=2)
    with pytest.raises(ValueError, match="snapshots its workers after every batch, got snapshot_every_n_steps=5"):
        ResumableStreamLoader(Stream(), snapshot_every_n_steps=5)


@pytest.mark.multiprocess
def test_statefuldataloader_workers_repeat_a_stream_resumed_near_an_epochs_end(tmp_path):
    """Why ResumableStreamLoader refuses workers, measured: StatefulDataLoader with 2 workers (one shard already
    exhausted), saved from before the read-ahead, resumes and trains 30 samples of the next epoch twice."""

    class WithWorkers(ResumableStreamLoader):
        def __init__(self, dataset, batch_size=1, num_workers=0):
            StatefulDataLoader.__init__(self, dataset, batch_size=batch_size, num_workers=2, snapshot_every_n_steps=1)
            self._before_pull = None

    whole = fit(tmp_path / "whole", WithWorkers)
    first = fit(tmp_path / "cut", WithWorkers, stop_at=14)
    resumed = fit(tmp_path / "cut", WithWorkers, ckpt_path=find_resume_checkpoint(tmp_path / "cut" / "ck"))
    assert len(first.seen + resumed.seen) == len(whole.seen) + 30

    class NoState(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError, match="NoState has no state_dict"):
        ResumableStreamLoader(NoState())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(tmp_path, DataLoader)
    assert any("Use lightning_accel.ResumableStreamLoader over a stream" in str(w.message) for w in record)
