"""Heartbeats and the hang decision without a Trainer: who is named, on whose clock, through a real TCPStore."""

from __future__ import annotations

import torch.distributed as dist

from lightning_accel.monitor.heartbeat import Beat, LocalBoard, StallClock, StoreBoard, Verdict, Watch, find_hang
from lightning_accel.monitor.node_board import NodeBoard, node_folder


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


def test_store_board_publishes_reads_and_lets_only_one_verdict_win():
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    board = StoreBoard(store, world_size=2, prefix="p/0/1")
    assert board.read() == {} and board.read_verdict() is None  # no key yet, and no blocking get
    board.publish(beat(1, 4, "backward"))
    assert board.read() == {1: beat(1, 4, "backward")}
    board.publish(beat(0, 5, "data"))
    assert board.read() == {0: beat(0, 5, "data"), 1: beat(1, 4, "backward")}
    first, second = Verdict(0, 1).to_json(), Verdict(1, 1).to_json()
    assert board.swap_verdict("", first) == first
    assert board.swap_verdict("", second) == first  # the second poster saw no verdict: it does not win
    assert board.read_verdict() == first
    assert StoreBoard(store, world_size=2, prefix="p/1/1").read_verdict() is None  # a restart reads its own keys
    assert not board.all_dumped()
    board.mark_dumped(0)
    board.mark_dumped(1)
    assert board.all_dumped()
    local = LocalBoard()
    local.publish(beat(0, 1, "data"))
    assert local.read() == {0: beat(0, 1, "data")} and not local.all_dumped()
    local.mark_dumped(0)
    assert local.all_dumped()


class CountingStore:
    """A real TCPStore client that counts the operations and the keys each one touches."""

    def __init__(self, store) -> None:
        self.store, self.ops, self.keys = store, 0, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            self.ops += 1
            self.keys += len(args[0]) if isinstance(args[0], list) else 1
            return method(*args)

        return counted


def simulated_ranks(world: int, clock, takeover_s: float = 30.0):
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    counting = CountingStore(store)
    board = StoreBoard(counting, world_size=world, prefix="sim")
    return counting, [Watch(board, r, world, takeover_s=takeover_s, clock=clock) for r in range(world)]


def test_one_rank_judges_so_a_poll_costs_the_store_o_w_and_a_hang_reaches_every_rank():
    """64 simulated ranks on one real TCPStore: a steady poll is 2 operations a rank plus the judge's O(W) read,
    64 x 2 + 2 operations and 4 x 64 keys, not 64^2. Rank 37 stops making progress: the judge names it the
    first poll its stall passes its allowance, and every rank polling after it reads that report."""
    now = [0.0]
    counting, watches = simulated_ranks(64, lambda: now[0])
    progress = dict.fromkeys(range(64), 0)

    def poll_all():
        reports = {}
        for w in watches:
            report = w.poll(beat(w.rank, progress[w.rank], "forward", progress=progress[w.rank], allowance_s=5.0))
            if report is not None:
                reports[w.rank] = report
        return reports

    for _ in range(3):  # warm: every key exists
        now[0] += 1.0
        for r in progress:
            progress[r] += 1
        assert poll_all() == {}
    counting.ops = counting.keys = 0
    now[0] += 1.0
    for r in progress:
        progress[r] += 1
    assert poll_all() == {}
    assert (counting.ops, counting.keys) == (64 * 2 + 2, 64 * 4)  # 64 beats, 63 verdicts; the judge's 64 x 2 + 1
    reports: dict = {}
    for _ in range(8):
        now[0] += 1.0
        for r in progress:
            progress[r] += r != 37
        reports = poll_all()
        if reports:
            break
    # its last progress was published at t=4, which the judge (polling first in a round) reads at t=5: past 5 s at 11
    assert now[0] == 11.0
    # the judge names it, and every rank polling after it (here: the same round) reads the same report
    assert set(reports) == set(range(64))
    assert all(r.stuck_ranks == [37] and r.detected_by == 0 for r in reports.values())


def test_a_silent_judge_is_replaced_by_the_next_rank_which_still_finds_the_hang():
    """The judge (rank 0) dies: its beat and its verdict's tick stop. Rank 1 takes over after takeover_s of silence
    (rank 2 would after twice that), counts rank 0 as silent since its last tick, and names it once that passes
    its allowance; rank 2 then reads rank 1's verdict. A judge that comes back late steps down."""
    now = [0.0]
    _, watches = simulated_ranks(3, lambda: now[0], takeover_s=3.0)

    def poll(ranks, batches, phase="forward"):
        return {r: watches[r].poll(beat(r, batches, phase, progress=batches, allowance_s=5.0)) for r in ranks}

    for t in range(1, 4):
        now[0] = float(t)
        assert poll([0, 1, 2], t) == dict.fromkeys([0, 1, 2])
    found = {}
    for t in range(4, 20):
        now[0] = float(t)
        # rank 0 is gone in batch 3's forward; 1 and 2 wait in its backward (its all-reduce)
        found = {r: rep for r, rep in poll([1, 2], 3, "backward").items() if rep is not None}
        if found:
            break
    assert watches[1].judging and not watches[2].judging
    assert now[0] <= 3.0 + 5.0 + 2.0  # within the allowance (5 s) of rank 0's last progress, plus a poll or two
    assert found[1].stuck_ranks == [0] and found[1].detected_by == 1
    now[0] += 1.0
    assert poll([2], 3, "backward")[2].stuck_ranks == [0]
    # a judge that was only slow to start: it finds another's verdict and follows it
    now = [0.0]
    _, watches = simulated_ranks(2, lambda: now[0], takeover_s=3.0)
    for t in range(1, 6):
        now[0] = float(t)
        watches[1].poll(beat(1, t, "forward", progress=t))
    assert watches[1].judging
    now[0] = 6.0
    assert watches[0].poll(beat(0, 1, "forward", progress=1)) is None and not watches[0].judging


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


def node_ranks(tmp_path, nodes: int, per_node: int, clock, takeover_s: float = 30.0, verdict_every_s: float = 0.0):
    """``nodes`` x ``per_node`` simulated ranks on one real TCPStore, each node's ranks meeting in their folder."""
    store = CountingStore(dist.TCPStore("127.0.0.1", 0, 1, True))
    watches = []
    for rank in range(nodes * per_node):
        node, local = divmod(rank, per_node)
        board = NodeBoard(
            store, "fleet", node_folder(tmp_path, "job", node), rank, node, nodes, local, per_node,
            lead_takeover_s=takeover_s / (per_node + 1), verdict_every_s=verdict_every_s, clock=clock,
        )  # fmt: skip
        watches.append(Watch(board, rank, nodes * per_node, takeover_s=takeover_s, clock=clock))
    return store, watches


def test_a_nodes_leader_alone_talks_to_the_store_and_a_silent_leader_is_replaced(tmp_path):
    """4 nodes x 8 ranks: a steady poll costs the store 2 operations a node plus the judge's 2 (it was 2 a rank):
    the other ranks meet in their node's folder. Rank 8, node 1's leader, then goes silent (its process is stuck):
    rank 9 leads node 1 within the node's takeover time, node 1's other beats keep reaching the judge, and the
    judge names rank 8 once its allowance has passed; every rank of every node reads the report."""
    now = [0.0]
    store, watches = node_ranks(tmp_path, 4, 8, lambda: now[0], takeover_s=9.0)
    progress = dict.fromkeys(range(32), 0)
    silent: set[int] = set()

    def poll_all():
        reports = {}
        for w in watches:
            if w.rank in silent:
                continue
            b = beat(w.rank, progress[w.rank], "forward", progress=progress[w.rank], allowance_s=6.0)
            report = w.poll(b)
            if report is not None:
                reports[w.rank] = report
        return reports

    def step(stuck=()):
        now[0] += 1.0
        for r in progress:
            progress[r] += r not in stuck
        return poll_all()

    for _ in range(3):
        assert step() == {}
    store.ops = store.keys = 0
    assert step() == {}
    assert store.ops == 4 * 2 + 2  # each leader: its node's key and the verdict; the judge also checks and reads
    silent.add(8)
    reports = {}
    for _ in range(20):
        reports = step(stuck={8})
        if reports:
            break
    assert watches[9].board.leading and not watches[10].board.leading
    assert all(r.stuck_ranks == [8] and r.detected_by == 0 for r in reports.values())
    assert now[0] <= 4 + 6 + 3  # rank 8's last progress (t=4) + its allowance + a poll or two through the node
    assert set(reports) == set(range(32)) - {8}


def test_leaders_that_read_the_verdict_every_few_seconds_cost_the_store_one_write_a_poll(tmp_path):
    """A read is the store's costly operation (a request and an answer; a beat is a one-way write): with
    verdict_every_s=5 a leader reads the verdict once in 5 polls, and its node still sees it alive every poll."""
    now = [0.0]
    store, watches = node_ranks(tmp_path, 4, 8, lambda: now[0], verdict_every_s=5.0)
    for t in range(1, 4):
        now[0] = float(t)
        assert all(w.poll(beat(w.rank, t, "forward", progress=t)) is None for w in watches)
    store.ops = 0
    for t in range(4, 9):
        now[0] = float(t)
        assert all(w.poll(beat(w.rank, t, "forward", progress=t)) is None for w in watches)
    assert store.ops == 5 * (4 + 3) + 3  # a poll: 4 node keys and the judge's check, read and post; 3 leaders' reads
    assert not any(w.board.leading for w in watches if w.rank % 8)  # no follower took a lead: its leader is alive


def test_the_last_rank_of_a_node_to_leave_removes_its_folder_and_the_last_node_the_jobs(tmp_path):
    """2 nodes x 3 ranks meeting under tmp_path: rank 2 finishes first and leaves, yet its finished beat still
    reaches the judge through its node's leader (no hang named a minute later), and node 0's folder stays until
    its last rank has left; the job's folder goes with its last node."""
    now = [0.0]
    _, watches = node_ranks(tmp_path, 2, 3, lambda: now[0], takeover_s=9.0)
    job = tmp_path / "lightning_accel-sentinel-job"
    done = beat(2, 3, "finished", progress=3, allowance_s=float("inf"))
    for t in range(1, 4):
        now[0] = float(t)
        assert all(w.poll(done if w.rank == 2 and t == 3 else beat(w.rank, t, "forward", t)) is None for w in watches)
    watches[2].board.leave()
    for t in range(4, 64):  # the others keep training for a minute
        now[0] = float(t)
        assert all(w.poll(beat(w.rank, t, "forward", t)) is None for w in watches if w.rank != 2)
    assert sorted(p.name for p in (job / "node0").iterdir()) == [
        "beat-0.json", "beat-1.json", "beat-2.json", "left-2", "verdict.json"
    ]  # fmt: skip
    for rank in (1, 0):
        assert (job / "node0").is_dir()
        watches[rank].board.leave()
    assert not (job / "node0").exists() and (job / "node1").is_dir()
    for rank in (5, 3, 4):
        watches[rank].board.leave()
    assert list(tmp_path.iterdir()) == []
