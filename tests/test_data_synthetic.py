"""Synthetic DataModules and the resumable loader."""

from __future__ import annotations

import torch

from lightning_accel.data import ResumableDataLoader, SyntheticClassificationDataModule, SyntheticTokenDataModule


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


def test_resumable_loader_skips_consumed_batches_of_same_epoch():
    data = torch.arange(20)
    full = ResumableDataLoader(data, batch_size=4, seed=7)
    full.sampler.set_epoch(2)
    expected = [b.tolist() for b in full]
    assert sorted(sum(expected, [])) == list(range(20))

    first = ResumableDataLoader(data, batch_size=4, seed=7)
    first.sampler.set_epoch(2)
    it = iter(first)
    seen = [next(it).tolist() for _ in range(3)]  # trained on 2, the 3rd is the fetcher's prefetch
    state = first.state_dict()
    assert state == {"epoch": 2, "batches_consumed": 2}

    resumed = ResumableDataLoader(data, batch_size=4, seed=7)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)
    assert seen[:2] + [b.tolist() for b in resumed] == expected
    assert resumed.state_dict() == {"epoch": 2, "batches_consumed": 5}  # exhausted: nothing prefetched


def test_resume_state_from_another_epoch_is_ignored():
    data = torch.arange(8)
    loader = ResumableDataLoader(data, batch_size=2, seed=0)
    loader.load_state_dict({"epoch": 0, "batches_consumed": 3})
    loader.sampler.set_epoch(1)
    assert len(list(loader)) == 4
