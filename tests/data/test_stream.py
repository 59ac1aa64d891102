"""Streams (IterableDataset) resume exactly through ResumableStreamLoader: no sample skipped or repeated, though
Lightning reads a batch ahead; the loaders that cannot say so at run time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
from tests.conftest import SigtermAt, tiny_trainer_kwargs


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


def fit(
    root: Path, loader_class: type, stop_at: int | None = None, ckpt_path: str | None = None, **loader_kwargs
) -> Net:
    torch.manual_seed(0)
    model = Net()
    callbacks = [PreemptionCheckpoint(root / "ck"), *([SigtermAt(stop_at)] if stop_at is not None else [])]
    trainer = Trainer(**tiny_trainer_kwargs(root, max_epochs=2, callbacks=callbacks))
    try:
        trainer.fit(model, loader_class(Stream(), batch_size=4, **loader_kwargs), ckpt_path=ckpt_path)
    except Preempted:
        pass
    return model


def assert_resumes_exactly(root: Path, stop_at: int, **loader_kwargs) -> None:
    whole = fit(root / "whole", ResumableStreamLoader, **loader_kwargs)
    assert sorted(whole.seen[:60]) == sorted(whole.seen[60:]) == list(range(60))  # every sample once an epoch
    first = fit(root / "cut", ResumableStreamLoader, stop_at=stop_at, **loader_kwargs)
    resumed = fit(
        root / "cut", ResumableStreamLoader, ckpt_path=find_resume_checkpoint(root / "cut" / "ck"), **loader_kwargs
    )
    assert 0 < len(first.seen) < len(whole.seen)
    assert first.seen + resumed.seen == whole.seen  # the batch Lightning read ahead is trained after the resume
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


# mid-epoch; the epoch's last batch (the save moves to the next epoch's first step); in the second epoch
@pytest.mark.parametrize("stop_at", [3, 14, 20])
def test_a_stream_resumes_with_no_sample_skipped_or_repeated(tmp_path, stop_at):
    assert_resumes_exactly(tmp_path, stop_at)


@pytest.mark.multiprocess
def test_a_stream_in_loader_workers_resumes_exactly_even_after_one_shard_ended(tmp_path):
    """Two workers, each its own shard of 30 (8 batches, the last of 2). Cut at 3 (mid-epoch), at 14 (worker 1's
    shard has ended, worker 0's has not: without the ended flag worker 1 would replay its 30 samples) and at 20
    (second epoch). One process covers the three cuts."""
    for stop_at in (3, 14, 20):
        assert_resumes_exactly(tmp_path / str(stop_at), stop_at, num_workers=2)


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
    with pytest.raises(ValueError, match="snapshots its workers after every batch, got snapshot_every_n_steps=5"):
        ResumableStreamLoader(Stream(), snapshot_every_n_steps=5)


def test_a_stream_without_state_is_refused_and_a_plain_dataloader_warns(tmp_path):
    class NoState(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError, match="NoState has no state_dict"):
        ResumableStreamLoader(NoState())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(tmp_path, DataLoader)
    assert any("Use lightning_accel.ResumableStreamLoader over a stream" in str(w.message) for w in record)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stream_resumes_exactly_on_two_ddp_ranks(tmp_path):
    """2 gloo ranks, each its own half of the stream and each of its 2 workers a quarter; the SIGTERM reaches rank 1
    only, in the second epoch. Each rank trains the same ids as in the uninterrupted run, and the weights are equal.
    (Without workers, DDP adds nothing the one-process cuts above and this case do not cover.)"""
    workers, stop_at = 2, 11
    script = Path(__file__).parent / "stream_ddp.py"
    # the three fits one after another in the same two ranks (one launch; each fit as fresh as a new process's)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), str(tmp_path)]
    cmd += ["whole,cut,resume", str(stop_at)]
    env = {**os.environ, "WORKERS": str(workers)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(2):
        whole, cut, resumed = (
            json.loads((tmp_path / f"{p}-rank{rank}.json").read_text()) for p in ("whole", "cut", "resume")
        )
        assert len(whole["seen"]) == 60 and sorted(whole["seen"][:30]) == sorted(whole["seen"][30:])
        assert 0 < len(cut["seen"]) < 60 and cut["seen"] + resumed["seen"] == whole["seen"], rank
        assert resumed["weights"] == whole["weights"], rank
