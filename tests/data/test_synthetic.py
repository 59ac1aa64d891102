"""Synthetic DataModules and the resumable loader."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.data import ResumableDataLoader
from lightning_accel.demos import SyntheticClassificationDataModule, SyntheticTokenDataModule


def test_token_data_follows_its_recurrence_and_is_seeded():
    dm = SyntheticTokenDataModule(num_samples=8, val_samples=2, seq_len=5, vocab_size=11, batch_size=4, seed=3)
    dm.setup()
    x, y = dm.train_set.tensors
    assert x.shape == y.shape == (8, 5) and x.dtype == torch.int64
    assert torch.equal(y, (5 * x + 3) % 11)
    assert torch.equal(x[:, 1:], y[:, :-1])
    again = SyntheticTokenDataModule(num_samples=8, val_samples=2, seq_len=5, vocab_size=11, batch_size=4, seed=3)
    again.setup()
    assert torch.equal(again.train_set.tensors[0], x)


def test_classification_labels_come_from_teacher():
    dm = SyntheticClassificationDataModule(num_samples=64, val_samples=16, input_dim=8, num_classes=3, seed=1)
    dm.setup()
    x, y = dm.train_set.tensors
    assert x.shape == (64, 8) and set(y.tolist()) <= {0, 1, 2}
    assert len(dm.val_set) == 16


def epoch_order(data, epoch, **kw):
    loader = ResumableDataLoader(data, **kw)
    loader.sampler.set_epoch(epoch)
    return [b.tolist() for b in loader]


def test_resumable_loader_skips_consumed_batches_of_same_epoch():
    data = torch.arange(20)
    expected = epoch_order(data, 2, batch_size=4, seed=7)
    assert sorted(i for batch in expected for i in batch) == list(range(20))

    first = ResumableDataLoader(data, batch_size=4, seed=7)
    first.sampler.set_epoch(2)
    it = iter(first)
    seen = [next(it).tolist() for _ in range(2)]
    state = first.state_dict()
    assert state == {"epoch": 2, "batches_consumed": 2, "world_size": 1, "batch_size": 4, "order": 2}

    resumed = ResumableDataLoader(data, batch_size=4, seed=7)
    resumed.load_state_dict(state)  # sets the epoch itself: Lightning iterates before set_epoch on resume
    assert seen + [b.tolist() for b in resumed] == expected
    assert resumed.state_dict() == {
        "epoch": 3,
        "batches_consumed": 0,
        "world_size": 1,
        "batch_size": 4,
        "order": 2,
    }  # exhausted: next epoch's start


def test_state_after_an_epoch_points_at_the_next_one():
    data = torch.arange(8)
    loader = ResumableDataLoader(data, batch_size=2, seed=0)
    assert len(list(loader)) == 4
    resumed = ResumableDataLoader(data, batch_size=2, seed=0)
    resumed.load_state_dict(loader.state_dict())
    assert [b.tolist() for b in resumed] == epoch_order(data, 1, batch_size=2, seed=0)


def test_bad_resume_state_is_a_clear_error():
    with pytest.raises(ValueError, match="missing \\['batches_consumed'\\]"):
        ResumableDataLoader(torch.arange(4)).load_state_dict({"epoch": 1})


def test_loaders_before_setup_name_the_fix():
    dm = SyntheticTokenDataModule()
    with pytest.raises(RuntimeError, match=r"train_dataloader\(\) before setup\(\): call dm.setup\('fit'\)"):
        dm.train_dataloader()
    with pytest.raises(RuntimeError, match=r"val_dataloader\(\) before setup\(\)"):
        dm.val_dataloader()
