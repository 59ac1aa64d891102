"""The work a change of membership costs: after the checkpoint, the restart, the replay, each measured (the replay
once, by the accounting that counts it as lost work)."""

from __future__ import annotations

from lightning_accel.monitor import membership
from lightning_accel.monitor.accounting import GoodputAccounting
from lightning_accel.monitor.membership import Change, MembershipLog


def resumed_accounting(clock: list[float]) -> GoodputAccounting:
    accounting = GoodputAccounting(clock=lambda: clock[0])
    accounting.resumed = True  # it loaded a checkpoint's state
    return accounting


def test_each_change_is_split_into_its_three_parts_and_carried_across_attempts():
    clock = [100.0]
    log, accounting = MembershipLog(), resumed_accounting(clock)
    assert log.metrics() == {}
    # checkpoint at wall 1000, the old group last recorded progress at 1004, the new group trains again at 1010
    assert accounting.begin_attempt(6, 8) == 2  # resumed at step 6, the old group had reached 8
    change = log.begin(2, 1, step=6, checkpoint_at=1000.0, last_progress_at=1004.0, now=1010.0)
    assert (change.checkpoint_to_failure_s, change.restart_s, change.replay_s) == (4.0, 6.0, 0.0)
    clock[0] = 102.5
    assert accounting.reached(7) is None  # not yet where the old group had got
    clock[0] = 103.0
    log.replayed(accounting.reached(8))
    assert change.replay_s == 3.0 and change.lost_s == 13.0 and accounting.lost_s == 3.0  # one measurement, two uses
    assert accounting.reached(9) is None and accounting.end_attempt() is None  # the replay is over
    assert "2 -> 1 rank(s) at step 6: 13.0 s lost" in change.describe()
    # a join with no progress file (the failure time unknown: all of it is restart) and nothing to replay
    log.begin(1, 2, step=12, checkpoint_at=2000.0, last_progress_at=None, now=2005.0)
    assert log.metrics() == {
        "goodput/membership_changes": 2.0,
        "goodput/membership_lost_s": 18.0,
        "goodput/last_change_lost_s": 5.0,
    }
    again = MembershipLog()
    again.load_state_dict(log.state_dict())  # in the checkpoint: the next attempt reports the whole run
    assert again.changes == log.changes and again.metrics() == log.metrics()
    assert set(log.metrics()) == set(membership.MEMBERSHIP_KEYS)


def test_an_attempt_that_ends_before_catching_up_counts_what_it_replayed():
    clock = [0.0]
    log, accounting = MembershipLog(), resumed_accounting(clock)
    accounting.begin_attempt(10, 20)
    log.begin(4, 2, step=10, checkpoint_at=50.0, last_progress_at=49.0, now=60.0)
    clock[0] = 7.0
    log.replayed(accounting.end_attempt())
    assert log.changes == [Change(4, 2, 10, 0.0, 10.0, 7.0)]  # progress before the checkpoint: nothing after it
    assert accounting.lost_s == 7.0
