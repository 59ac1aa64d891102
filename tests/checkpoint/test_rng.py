"""Generator states in a checkpoint (checkpoint/rng.py), without a Trainer."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from lightning_accel.checkpoint.rng import capture_rng, restore_rng


def draws() -> tuple[list[float], list[float], list[float]]:
    return [random.random() for _ in range(3)], np.random.rand(3).tolist(), torch.rand(3).tolist()


def leaves(state: object) -> int:
    """What a walk of the checkpoint (Lightning's apply_to_collection, our staging copy) visits one by one."""
    if isinstance(state, dict):
        return sum(leaves(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(leaves(v) for v in state)
    return 1


def test_a_state_saved_with_weights_only_restores_every_generators_next_draws():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # (Python's state then carries a cached gauss value too)
    buffer = io.BytesIO()
    torch.save(capture_rng(), buffer)
    expected = draws()
    buffer.seek(0)
    restore_rng(torch.load(buffer, weights_only=True))
    assert draws() == expected


def test_the_state_is_a_few_leaves_not_the_twisters_625_integers():
    """An async save walks the checkpoint on the training thread: the keys are one tensor each, not 625 ints."""
    state = capture_rng()
    assert leaves(state) < 20
    assert state["python"][1].dtype == torch.int64 and state["python"][1].numel() == 625


def test_a_checkpoint_written_with_pythons_state_as_a_tuple_still_restores():
    random.seed(7)
    legacy = {**capture_rng(), "python": random.getstate()}  # what checkpoints held before
    expected = draws()
    restore_rng(legacy)
    assert draws() == expected
