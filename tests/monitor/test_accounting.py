"""GoodputAccounting without a Trainer: the straggler figure is robust to one slow interval."""

from __future__ import annotations

import pytest

from lightning_accel.monitor.accounting import STRAGGLER_MIN_INTERVALS, STRAGGLER_WINDOW, GoodputAccounting


def test_one_slow_interval_names_no_straggler_and_a_steadily_slow_rank_is_named():
    acc = GoodputAccounting()
    for _ in range(5):
        acc.set_rank_step_times([0.010, 0.010, 0.010, 0.010])
    acc.set_rank_step_times([0.010, 0.010, 0.050, 0.010])  # one hiccup on rank 2
    assert acc.straggler_ratio == pytest.approx(1.0)  # the median of rank 2's intervals is still 10 ms
    for _ in range(STRAGGLER_WINDOW):
        acc.set_rank_step_times([0.010, 0.013, 0.010, 0.010])  # rank 1 30% slower, every interval
    assert acc.slowest_rank == 1 and acc.straggler_ratio == pytest.approx(1.3)
    assert acc.goodput()["goodput/slowest_rank"] == 1.0


def test_a_changed_world_size_starts_the_window_over():
    acc = GoodputAccounting()
    acc.set_rank_step_times([0.01, 0.02])
    acc.set_rank_step_times([0.01, 0.01, 0.03])
    assert acc.slowest_rank == 2 and acc.straggler_ratio == pytest.approx(3.0)


def test_a_straggler_must_stand_out_from_the_other_ranks_spread_too():
    acc = GoodputAccounting()
    for _ in range(STRAGGLER_WINDOW):
        acc.set_rank_step_times([0.010, 0.020, 0.030, 0.038])  # ranks all over the place: rank 3 is no outlier
    assert acc.slowest_rank == 3 and acc.straggler_ratio == pytest.approx(1.9)
    assert acc.straggler_rank is None and acc.goodput()["goodput/straggler_rank"] == -1.0
    for _ in range(STRAGGLER_WINDOW):
        acc.set_rank_step_times([0.020, 0.021, 0.019, 0.026])  # tight others, rank 3 30% above their median
    assert acc.straggler_rank == 3 and acc.straggler_ratio == pytest.approx(1.3)
    assert acc.rank_step_s == pytest.approx([0.020, 0.021, 0.019, 0.026])
    assert acc.straggler_intervals == STRAGGLER_WINDOW


def test_no_straggler_from_a_short_window_a_first_interval_or_two_ranks_taking_turns():
    """What a balanced short-step run gave (1.2-1.36x of a 4-5 ms window), a 3 s first step on one rank, and two
    ranks whose slower one changes from interval to interval: none is a straggler. A steadily slower one of two is."""
    acc = GoodputAccounting()
    for _ in range(STRAGGLER_WINDOW):
        acc.set_rank_step_times([0.0040, 0.0054, 0.0041, 0.0040])  # 1.35x, but 1.4 ms a step
    assert acc.straggler_ratio == pytest.approx(1.35, rel=0.01) and acc.straggler_rank is None
    first = GoodputAccounting()
    first.set_rank_step_times([0.050, 3.0])  # one rank's first step compiled for 3 s
    first.set_rank_step_times([0.050, 0.050])
    assert first.straggler_rank is None  # two intervals: too few to name anyone
    assert STRAGGLER_MIN_INTERVALS == 3
    turns = GoodputAccounting()
    for i in range(STRAGGLER_WINDOW):
        turns.set_rank_step_times([0.040, 0.052] if i % 2 else [0.052, 0.040])  # 1.3x, but each rank in turn
    assert turns.straggler_rank is None
    steady = GoodputAccounting()
    for i in range(STRAGGLER_WINDOW):
        steady.set_rank_step_times([0.040 + 0.002 * (i % 3), 0.052])  # rank 1 slower in every interval
        assert steady.straggler_rank == (1 if i + 1 >= STRAGGLER_MIN_INTERVALS else None), i
