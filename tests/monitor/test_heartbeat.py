"""Heartbeats and the hang decision without a Trainer: who is named, on whose clock, through a real TCPStore."""

from __future__ import annotations

import torch.distributed as dist

from lightning_accel.monitor.heartbeat import Beat, LocalBoard, StallClock, StoreBoard, find_hang


def beat(rank: int, batches: int, phase: str, progress: int = 1, allowance_s: float = 5.0) -> Beat:
    return Beat(
        rank=rank,
        host=f"h{rank}",
        pid=100 + rank,
        batches=batches,
        step=batches,
        phase=phase,
        progress=progress,
        allowance_s=allowance_s,
    )


def test_the_rank_the_others_wait_for_is_named_once_any_rank_is_past_its_allowance():
    beats = {0: beat(0, 12, "backward"), 1: beat(1, 12, "forward"), 2: beat(2, 12, "backward")}
    assert find_hang(beats, {0: 4.9, 1: 4.9, 2: 4.9}, world_size=3, reader=0) is None
    report = find_hang(beats, {0: 5.1, 1: 4.0, 2: 5.2}, world_size=3, reader=2)
    assert report.stuck_ranks == [1] and report.overdue_ranks == [0, 2] and report.detected_by == 2
    assert "rank 1 (host h1, pid 101) in forward after 12 finished batches" in report.describe()
    # a rank one batch behind, waiting for data, is behind one in an earlier phase of a later batch
    beats = {0: beat(0, 13, "forward"), 1: beat(1, 12, "data")}
    assert find_hang(beats, {0: 6, 1: 6}, world_size=3, reader=0).stuck_ranks == [1]
    # all equally far: all named; a rank that never reported is listed
    beats = {0: beat(0, 3, "backward"), 1: beat(1, 3, "backward")}
    report = find_hang(beats, {0: 6, 1: 6}, world_size=3, reader=1)
    assert report.stuck_ranks == [0, 1] and report.missing_ranks == [2]
    assert "ranks [2] never sent a heartbeat" in report.describe()


def test_stalls_are_timed_on_the_readers_clock_from_the_last_change_of_progress():
    now = [100.0]
    clock = StallClock(lambda: now[0])
    assert clock.stalled({0: beat(0, 1, "data", progress=1)}) == {0: 0.0}
    now[0] = 103.0
    assert clock.stalled({0: beat(0, 1, "data", progress=1)}) == {0: 3.0}
    now[0] = 104.0
    assert clock.stalled({0: beat(0, 2, "forward", progress=2)}) == {0: 0.0}  # progress moved: stall restarts
    now[0] = 110.5
    assert clock.stalled({0: beat(0, 2, "forward", progress=2)}) == {0: 6.5}


def test_store_board_publishes_reads_and_keeps_the_first_posted_hang():
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    board = StoreBoard(store, world_size=2, prefix="p/0/1")
    assert board.read() == {} and board.posted_hang() is None  # no key yet, and no blocking get
    board.publish(beat(1, 4, "backward"))
    assert board.read() == {1: beat(1, 4, "backward")}
    board.publish(beat(0, 5, "data"))
    assert board.read() == {0: beat(0, 5, "data"), 1: beat(1, 4, "backward")}
    first = find_hang(board.read(), {0: 9, 1: 9}, world_size=2, reader=0)
    second = find_hang(board.read(), {0: 9, 1: 9}, world_size=2, reader=1)
    board.post_hang(first)
    board.post_hang(second)
    assert board.posted_hang() == first
    assert StoreBoard(store, world_size=2, prefix="p/1/1").posted_hang() is None  # a restart reads its own keys
    assert not board.all_dumped()
    board.mark_dumped(0)
    board.mark_dumped(1)
    assert board.all_dumped()
    local = LocalBoard()
    local.publish(beat(0, 1, "data"))
    assert local.read() == {0: beat(0, 1, "data")} and local.all_dumped()


def test_a_finished_rank_is_never_overdue_and_its_beat_survives_the_store():
    """A rank whose training is over publishes "finished" with no allowance limit: its silence while another rank
    exports or uploads after the last step (or after it has ended) is no hang, and the beat goes through JSON."""
    finished = beat(1, 40, "finished", allowance_s=float("inf"))
    assert Beat.from_json(finished.to_json()) == finished
    beats = {0: beat(0, 40, "finished", allowance_s=float("inf")), 1: finished}
    assert find_hang(beats, {0: 3600.0, 1: 3600.0}, world_size=2, reader=0) is None
    # a rank still training behind a finished one is still named when it stalls past its allowance
    beats = {0: beat(0, 39, "forward"), 1: finished}
    assert find_hang(beats, {0: 5.1, 1: 3600.0}, world_size=2, reader=1).stuck_ranks == [0]
