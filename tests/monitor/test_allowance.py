"""The hang sentinel's allowance, Trainer-free (lightning_accel/monitor/allowance.py)."""

from __future__ import annotations

import math

import pytest

from lightning_accel.monitor.allowance import WINDOW, Allowance


def test_each_phase_gets_factor_times_its_typical_time_above_the_floor():
    allowance = Allowance(factor=10, floor_s=2, startup_s=900)
    assert allowance.for_phase("forward") == 900  # nothing measured yet: the first batch compiles
    for seconds in (0.1, 0.5, 0.3):
        allowance.record("train", seconds)
    assert allowance.for_phase("forward") == pytest.approx(3.0)  # 10 x the median 0.3
    assert allowance.for_phase("data") == allowance.for_phase("optimizer")  # every step phase: a training batch
    allowance.record("train", 0.01)
    allowance.record("train", 0.01)
    assert allowance.for_phase("backward") == 2  # 10 x 0.1 under the floor
    assert allowance.for_phase("validation") == 900  # no validation batch measured yet
    allowance.record("save", 1.0)
    allowance.record("save", 30.0)
    allowance.record("save", 2.0)
    assert allowance.for_phase("checkpoint") == 300  # saves: the longest, as they vary in size
    assert allowance.for_phase("finished") == math.inf  # after training, nothing to time
    for _ in range(WINDOW):
        allowance.record("train", 1.0)
    assert allowance.for_phase("forward") == 10  # the window forgot the short ones


def test_a_bad_setting_is_one_line_naming_it():
    with pytest.raises(ValueError, match="HangSentinel: floor_s must be > 0, got 0"):
        Allowance(factor=10, floor_s=0, startup_s=900)
