"""The global order in O(1) memory: a keyed permutation computed per index, a rank's slots computed from slot
numbers, the same deal as the list-based one it replaced, and loader states of the earlier order still exact."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from lightning_accel import ResumableDataLoader
from lightning_accel.data import ResumableSampler
from lightning_accel.data.global_order import (
    LEGACY_ORDER_VERSION,
    ORDER_VERSION,
    DealtSlots,
    EpochOrder,
    FeistelPermutation,
)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 97, 1000, 4097, 65536])
def test_the_keyed_permutation_is_a_bijection_of_its_range_and_depends_on_seed_and_epoch_only(n):
    order = FeistelPermutation(n, seed=3, epoch=1)(np.arange(n))
    assert sorted(order.tolist()) == list(range(n))
    assert np.array_equal(order, FeistelPermutation(n, seed=3, epoch=1)(np.arange(n)))  # the same every time
    if n >= 97:
        assert not np.array_equal(order, np.arange(n))
        assert not np.array_equal(order, FeistelPermutation(n, seed=3, epoch=2)(np.arange(n)))
        assert not np.array_equal(order, FeistelPermutation(n, seed=4, epoch=1)(np.arange(n)))
        # a shuffle, not a rotation: consecutive positions land far apart
        assert np.abs(np.diff(order)).mean() > n / 10


def reference_deal(order, batch, world, rank, start, drop_last, fill=False):
    """The list-based deal this module replaced: cut, deal round robin from ``start``, pad with the first slots."""
    count = len(order) // batch if drop_last else math.ceil(len(order) / batch)
    slots = [order[i * batch : (i + 1) * batch] for i in range(count)]
    if fill and slots and len(slots[-1]) < batch:
        slots[-1] = slots[-1] + slots[-1][-1:] * (batch - len(slots[-1]))
    rest = slots[start:]
    uneven = len(rest) % world
    if uneven and drop_last:
        rest = rest[: len(rest) - uneven]
    elif uneven and slots:
        rest += [slots[i % len(slots)] for i in range(world - uneven)]
    return rest[rank::world]


def test_a_ranks_slots_computed_from_slot_numbers_are_the_list_based_deal():
    for n in (0, 1, 7, 22, 96, 101):
        order = EpochOrder(n, seed=5, epoch=2, shuffle=True)
        listed = order.as_list()
        for batch in (1, 4, 8):
            for world in (1, 3, 8):
                for start in sorted({0, 1, 3, max(n // batch - 1, 0)}):
                    for drop_last in (False, True):
                        for rank in range(world):
                            expected = reference_deal(listed, batch, world, rank, start, drop_last)
                            mine = DealtSlots(n, batch, drop_last, start, world, rank)
                            assert len(mine) == len(expected), (n, batch, world, start, drop_last, rank)
                            got = list(mine.indices(order, chunk_slots=16))
                            assert got == [i for b in expected for i in b], (n, batch, world, start, drop_last, rank)
                            if world == 3:  # one batch at a time (DALI's source) too
                                assert [mine.batch(order, k) for k in range(len(mine))] == expected
                        filled = reference_deal(listed, batch, world, 0, start, drop_last=False, fill=True)
                        mine = DealtSlots(n, batch, False, start, world, 0, fill=True)
                        assert [mine.batch(order, k) for k in range(len(mine))] == filled


def test_a_billion_samples_give_the_first_index_at_once_without_a_list_of_the_epoch():
    sampler = ResumableSampler(range(10**9), seed=1, num_replicas=512, rank=511, batch_size=32)
    sampler.set_epoch(3)
    began = time.perf_counter()
    first = list(zip(range(64), iter(sampler), strict=False))
    took = time.perf_counter() - began
    assert all(0 <= index < 10**9 for _, index in first) and len({i for _, i in first}) == 64
    assert len(sampler) == math.ceil(math.ceil(10**9 / 32) / 512) * 32
    assert took < 5.0, f"{took:.2f} s for the first indices of 10^9 samples: the order is being listed"


def test_a_loader_state_of_the_earlier_order_resumes_in_that_order_and_an_unknown_one_is_refused(caplog):
    """A state without a version (written before it existed) names torch.randperm's order: the rest of that epoch
    and the epochs after it come in that order, as the run that wrote it would have trained them."""
    data = torch.arange(40)
    old = torch.randperm(40, generator=torch.Generator().manual_seed(7 + 1)).tolist()  # seed 7, epoch 1
    loader = ResumableDataLoader(data, batch_size=4, seed=7, per_sample_seed=False)
    with caplog.at_level("INFO"):
        loader.load_state_dict({"epoch": 1, "batches_consumed": 3, "world_size": 1, "batch_size": 4})
    assert "order of version 1 (torch.randperm per epoch)" in caplog.text
    assert [b.tolist() for b in loader] == [old[i : i + 4] for i in range(12, 40, 4)]
    assert loader.state_dict()["order"] == LEGACY_ORDER_VERSION
    fresh = ResumableDataLoader(data, batch_size=4, seed=7, per_sample_seed=False)
    fresh.sampler.set_epoch(1)
    assert fresh.state_dict()["order"] == ORDER_VERSION
    new = [b.tolist() for b in fresh]
    assert sorted(i for b in new for i in b) == list(range(40)) and new != [old[i : i + 4] for i in range(0, 40, 4)]
    with pytest.raises(ValueError, match=r"unknown order version 9 .* knows 1 and 2"):
        fresh.load_state_dict({"epoch": 1, "batches_consumed": 3, "order": 9})
