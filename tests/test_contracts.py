"""The Protocols the rooms check each other's objects by (lightning_accel/contracts.py)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_accel import ResumableDataLoader
from lightning_accel.contracts import FollowsWorldSize, Stateful, follows_world_size, is_stateful
from lightning_accel.strategies.deepspeed import AccelDeepSpeedStrategy


def test_loaders_and_strategies_say_what_they_resume_through_the_protocols():
    data = TensorDataset(torch.arange(8.0))
    ours, stateful, plain = ResumableDataLoader(data, batch_size=2), StatefulDataLoader(data), DataLoader(data)
    assert [is_stateful(x) for x in (ours, stateful, plain)] == [True, True, False]
    assert is_stateful(StatefulDataLoader) and not is_stateful(DataLoader)  # classes too
    assert isinstance(ours, Stateful) and isinstance(ours, FollowsWorldSize)
    assert [follows_world_size(x) for x in (ours, stateful, plain)] == [True, False, False]
    assert AccelDeepSpeedStrategy.follows_world_size is True  # read from the Trainer's strategy at a resume

    class Declines:
        follows_world_size = False  # has the attribute, and says no

    assert isinstance(Declines(), FollowsWorldSize) and not follows_world_size(Declines())
