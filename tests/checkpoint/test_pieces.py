"""PreemptionCheckpoint's Trainer-free pieces, tested directly: the stop flag and its signal handlers (StopSignals),
retention (KeepLast) and the save timer against the grace period (SaveTimer). No Trainer, no process group."""

from __future__ import annotations

import os
import signal
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_accel.checkpoint import atomic_save
from lightning_accel.checkpoint.durable import manifest_path
from lightning_accel.checkpoint.retention import KeepLast
from lightning_accel.checkpoint.save_timing import SaveTimer
from lightning_accel.checkpoint.signals import StopSignals, parse_signal


# -- StopSignals ----------------------------------------------------------------------------------------------------
def test_signal_names_parse_and_a_bad_one_is_named_with_the_fix():
    assert parse_signal("SIGTERM") is signal.SIGTERM and parse_signal(int(signal.SIGUSR1)) is signal.SIGUSR1
    for bad in ("TERM", "sigterm", 999):
        with pytest.raises(ValueError, match=rf"Unknown signal {bad!r}; use names like 'SIGTERM'"):
            StopSignals([bad])


def test_a_signal_raises_the_flag_calls_the_users_handler_and_restore_puts_it_back():
    seen: list[int] = []

    def users(signum, frame):
        seen.append(signum)

    before = signal.signal(signal.SIGUSR1, users)
    try:
        stop = StopSignals(["SIGUSR1"])
        stop.remember_previous()
        assert stop.install() and signal.getsignal(signal.SIGUSR1) == stop.handle
        assert stop.received is None and stop.name() == "a peer rank's signal"
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal: Python runs the handler before the next bytecode
        assert stop.received == signal.SIGUSR1 and stop.received_at is not None
        assert seen == [signal.SIGUSR1]  # chained: the user's own handler still ran
        assert stop.name() == "SIGUSR1"
        stop.restore()
        assert signal.getsignal(signal.SIGUSR1) is users
        stop.reset()
        assert (stop.received, stop.received_at, stop.reason) == (None, None, None)
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_nothing_to_chain_restores_the_default_and_restore_leaves_a_newer_handler_alone():
    before = signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    try:
        stop = StopSignals(["SIGUSR2"])
        stop.remember_previous()
        stop.install()
        assert stop.previous(signal.SIGUSR2) == signal.SIG_DFL
        stop.restore()
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
        stop.install()

        def newer(signum, frame):
            pass

        signal.signal(signal.SIGUSR2, newer)  # someone installed theirs after ours: not ours to undo
        stop.restore()
        assert signal.getsignal(signal.SIGUSR2) is newer
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_a_request_without_a_signal_names_its_reason_and_off_the_main_thread_nothing_is_installed():
    stop = StopSignals(["SIGUSR1"])
    before = signal.getsignal(signal.SIGUSR1)
    installed: list[bool] = []
    worker = threading.Thread(target=lambda: (installed.append(stop.install()), stop.restore()))
    worker.start()
    worker.join()
    assert installed == [False] and signal.getsignal(signal.SIGUSR1) == before
    stop.request("AWS spot interruption notice")  # from a notice-polling thread, say
    assert stop.received == 0 and stop.received_at is not None
    assert stop.name() == "AWS spot interruption notice"


# -- KeepLast -------------------------------------------------------------------------------------------------------
def save(folder: Path, step: int, run_id: str) -> Path:
    path = folder / f"step={step:08d}.ckpt"
    atomic_save({"global_step": step, "weights": [step] * 64}, path, {"global_step": step, "run_id": run_id})
    return path


@pytest.fixture
def folder_of_two_runs(tmp_path) -> Path:
    """Steps 1-4 of run A and steps 5-6 of run B (another run sharing the folder), each with its manifest."""
    for step in (1, 2, 3, 4):
        save(tmp_path, step, "A")
    for step in (5, 6):
        save(tmp_path, step, "B")
    return tmp_path


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_keep_last_deletes_only_this_runs_older_checkpoints_with_their_manifests(folder_of_two_runs):
    folder = folder_of_two_runs
    KeepLast(None).prune(folder, "A")  # keep everything
    assert len(names(folder)) == 12
    KeepLast(2).prune(folder, "A")
    kept = [f"step={s:08d}.ckpt" for s in (3, 4, 5, 6)]
    assert names(folder) == sorted(kept + [k + ".manifest.json" for k in kept])  # B's are not A's to delete


def test_a_corrupt_checkpoint_does_not_count_and_one_without_a_manifest_is_left_alone(folder_of_two_runs, caplog):
    folder = folder_of_two_runs
    newest = folder / "step=00000004.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size, one flipped byte: only the checksum knows
    newest.write_bytes(bytes(data))
    in_flight = save(folder, 7, "A")
    manifest_path(in_flight).unlink()  # an async write renamed, its manifest not written yet
    KeepLast(2).prune(folder, "A")
    steps = sorted(int(p.name[5:13]) for p in folder.glob("*.ckpt"))
    assert steps == [2, 3, 4, 5, 6, 7]  # 2 and 3 are the two valid ones kept; 1 went; 4 and 7 are not counted
    assert "step=00000004.ckpt does not count towards keep_last" in caplog.text


# -- SaveTimer ------------------------------------------------------------------------------------------------------
def test_the_first_save_over_the_grace_period_warns_once_with_the_numbers():
    with pytest.raises(ValueError, match="grace_period_s must be positive, got 0"):
        SaveTimer(0)
    timer = SaveTimer(grace_period_s=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        timer.record(2.0)  # fits
        timer.record(12.5)  # the first that does not: warned, although it is not the first save
        timer.record(30.0)  # said once is enough
    assert timer.seconds == [2.0, 12.5, 30.0]
    (warning,) = [w for w in caught if "grace period" in str(w.message)]
    assert "a save took 12.5 s from start to durable, over the 10 s grace period" in str(warning.message)
    timer.reset()
    assert timer.seconds == []


def test_an_async_save_is_timed_when_its_write_is_durable():
    timer = SaveTimer(grace_period_s=60)
    write = SimpleNamespace(finished=None)
    timer.wait_for(100.0, write)
    timer.record_finished_write()  # still writing: nothing recorded yet
    assert timer.seconds == []
    write.finished = 103.5
    timer.record_finished_write()
    timer.record_finished_write()  # recorded once
    assert timer.seconds == [3.5]


# -- what other callbacks may ask of PreemptionCheckpoint -----------------------------------------------------------
def test_other_callbacks_stop_the_run_and_shorten_the_grace_through_two_public_methods(tmp_path):
    """PreemptionNotices (a cloud's notice) uses these, not the checkpoint's internals."""
    from lightning_accel import PreemptionCheckpoint

    checkpoint = PreemptionCheckpoint(tmp_path, grace_period_s=30)
    checkpoint.limit_grace(10)  # a notice gives 10 s
    checkpoint.limit_grace(20)  # a longer lead never lengthens what was promised
    assert checkpoint.grace_period_s == 10
    checkpoint.request_stop("GCP preemption notice")
    assert checkpoint.stop_signals.received == 0 and checkpoint.stop_signals.name() == "GCP preemption notice"


# -- sharded folders across machines --------------------------------------------------------------------------------
def test_ranks_that_do_not_see_rank_zeros_folder_are_found_and_a_sharded_save_there_is_refused(tmp_path):
    """Two ranks as threads (tests/helpers/thread_ranks.py). Sharing one folder, both see rank 0's marker; each
    with its own folder (two machines' local disks), neither agrees. Destination.check_writable then refuses a
    strategy that saves folders of shards, naming the folder and the fix, for a local folder and for a bucket,
    and leaves no marker behind."""
    from lightning_accel.checkpoint.destination import Destination
    from lightning_accel.checkpoint.sharded import ranks_share_folder
    from tests.helpers.thread_ranks import ThreadRanks

    shared = tmp_path / "shared"
    shared.mkdir()
    assert ThreadRanks(2).run(lambda strategy, rank: ranks_share_folder(strategy, rank == 0, shared)) == [True] * 2
    machines = [tmp_path / "machine-0", tmp_path / "machine-1"]
    for folder in machines:
        folder.mkdir()
    apart = ThreadRanks(2).run(lambda strategy, rank: ranks_share_folder(strategy, rank == 0, machines[rank]))
    assert apart == [False, False]
    assert [list(p.iterdir()) for p in [shared, *machines]] == [[], [], []]

    class ShardedStrategy:  # what FSDP2 with save_distributed_checkpoint=True says of itself
        _save_distributed_checkpoint = True

    def check(dirpath: str, local_dir_of_rank, sharded: bool = True) -> list[str]:
        """Destination.check_writable on both ranks, each writing into ``local_dir_of_rank(rank)``."""

        def rank_main(strategy, rank):
            if sharded:
                strategy.__class__ = type("ShardedStrategy", (type(strategy), ShardedStrategy), {})
            trainer = SimpleNamespace(strategy=strategy, is_global_zero=rank == 0, world_size=2)
            destination = type("OnThisRank", (Destination,), {"local_dir": local_dir_of_rank(rank)})(dirpath)
            try:
                destination.check_writable(trainer, "run", keep_last=2, grace_period_s=30)
            except OSError as err:
                return str(err)
            return "accepted"

        return ThreadRanks(2).run(rank_main)

    assert check(str(shared), lambda rank: shared) == ["accepted"] * 2
    assert check("memory://bucket/run", lambda rank: shared) == ["accepted"] * 2  # a staging folder both see
    # one file from rank 0 (DDP): only rank 0 writes, so machines apart are fine
    assert check(str(machines[0]), lambda rank: machines[rank], sharded=False) == ["accepted"] * 2
    local = check(str(machines[0]), lambda rank: machines[rank])
    for rank, said in enumerate(local):  # (every machine names the folder by the same path; here they differ)
        assert (
            f"ShardedStrategy saves a folder of shards, every rank its own, but some ranks do not see the files rank 0 "
            f"writes in {machines[rank]}" in said
        )
        assert "rank 0 would seal checkpoints without their shards" in said
        assert "Fix: give dirpath a folder on a file system every node mounts" in said
    for said in check("memory://bucket/run", lambda rank: machines[rank]):
        assert "rank 0 would upload checkpoints without their shards" in said
        assert "Fix: set LIGHTNING_ACCEL_CACHE_DIR to a folder on a file system every node mounts" in said
    assert [list(p.iterdir()) for p in [shared, *machines]] == [[], [], []]
