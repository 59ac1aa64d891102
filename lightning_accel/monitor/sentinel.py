"""HangSentinel: find the stuck rank in seconds instead of at the collective timeout, dump its stacks, exit.

A rank stuck in a collective, a deadlocked loader or an endless ``training_step`` leaves the others waiting until
the process group's timeout (gloo 30 min, NCCL 10 min). Here every rank's hooks record where it is (cheap: a few
attribute writes per hook), a watchdog thread per rank publishes that as a heartbeat on the job's own c10d store,
rank 0's judges every rank's and posts a verdict the others read (another rank takes over if it goes silent), and
when a rank has made no progress for longer than its phase allows, every rank dumps
all its threads' Python stacks (``faulthandler``) and, on CUDA, NCCL's flight recorder into ``<run>/hang/``,
the report names the rank(s) the others wait for, and each process exits with :data:`HANG_EXIT_CODE`, so
torchrun or Ray restart the job from its last checkpoint.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any

import psutil
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_accel._compat import default_store, nccl_flight_recorder_dump
from lightning_accel.data.worker_handoff import check_loaders
from lightning_accel.monitor.allowance import Allowance
from lightning_accel.monitor.heartbeat import Beat, Board, HangReport, LocalBoard, StoreBoard, Watch
from lightning_accel.monitor.node_board import NodeBoard, node_folder
from lightning_accel.monitor.run_folder import run_folder

__all__ = ["HANG_EXIT_CODE", "VERDICT_EVERY_S", "HangSentinel"]

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 76  # every process of a hung job exits with this (EX_PROTOCOL: the ranks stopped answering)
VERDICT_EVERY_S = 5.0  # a node's leader reads the judge's verdict this often: a hang found on another node waits
# Loader workers forked after setup inherit faulthandler's registration for this signal and its file: on a hang
# each child is sent it and writes its own stacks there (a worker blocked in __getitem__ shows the blocking line).
_CHILD_DUMP_SIGNAL = getattr(signal, "SIGUSR2", None)


class HangSentinel(Callback):
    """Detect a hung or stuck rank, dump every rank's stacks, name the stuck one, and exit the job.

    Args:
        factor: A phase may take this many times its median measured duration (a training batch, a validation
            batch; for checkpoint saves, the longest one so far) before it counts as hung.
        floor_s: The smallest allowance, whatever the measured times (noise on tiny steps is no hang).
        startup_s: The allowance for what has no measured time yet: the first training batch of an attempt
            (first compile, first collectives), the first validation batch and the first checkpoint save.
        poll_s: How often the watchdog publishes this rank's heartbeat and reads the verdict (rank 0: judges every
            rank's beats). Default:
            ``floor_s / 4`` capped at 1 s.
        exit_on_hang: Exit with :data:`HANG_EXIT_CODE` once the stacks are dumped. ``False`` only reports (the
            job then waits on, up to the collective timeout).
        dirpath: Where the ``hang/`` folder goes; default: the run's one folder (``monitor/run_folder.py``: the
            checkpoint folder, else ``trainer.log_dir``, else ``default_root_dir``).
    """

    def __init__(
        self,
        factor: float = 10.0,
        floor_s: float = 60.0,
        startup_s: float = 900.0,
        poll_s: float | None = None,
        exit_on_hang: bool = True,
        dirpath: str | Path | None = None,
    ) -> None:
        Allowance(factor, floor_s, startup_s)  # checks the three (one line naming a bad one), before any fit
        if poll_s is not None and poll_s <= 0:
            raise ValueError(f"HangSentinel: poll_s must be > 0, got {poll_s}")
        self.factor, self.floor_s, self.startup_s = factor, floor_s, startup_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, floor_s / 4)
        self.takeover_s = max(30.0, 10 * self.poll_s)  # a judge silent this long is replaced (heartbeat.Watch)
        self.exit_on_hang = exit_on_hang
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.report: HangReport | None = None  # set once a hang is found and its stacks are dumped
        self._hang_found = False  # from the moment the watchdog acts on one
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._fits = 0

    # -- where this rank is (main thread; plain attribute writes, read by the watchdog) -------------------------
    def _reset(self, trainer: Trainer) -> None:
        self._rank, self._world = trainer.global_rank, trainer.world_size
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._batches = self._progress = 0
        self._phase = "data"
        self._allowance = Allowance(self.factor, self.floor_s, self.startup_s)
        self._since = time.monotonic()  # start of what is being timed (a training batch, a val batch, a save)
        self._step = trainer.global_step
        self._save_started, self._save_resume_phase = self._since, "data"

    def _enter(self, phase: str) -> None:
        self._leave_checkpoint()
        self._phase = phase
        self._progress += 1

    def _finished(self, kind: str, trainer: Trainer, next_phase: str) -> None:
        self._leave_checkpoint()
        now = time.monotonic()
        self._allowance.record(kind, now - self._since)
        self._since = now
        self._step = trainer.global_step  # read once a batch: Lightning's property walks its loops
        self._enter(next_phase)

    def allowance_s(self) -> float:
        """How long the current phase may go without progress, from this rank's measured times."""
        return self._allowance.for_phase(self._phase)

    def beat(self) -> Beat:
        return Beat(
            rank=self._rank,
            host=self._host,
            pid=self._pid,
            batches=self._batches,
            step=self._step,
            phase=self._phase,
            progress=self._progress,
            allowance_s=self.allowance_s(),
        )

    # -- hooks ----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset(trainer)
        self._fits += 1
        self._board = self._make_board(trainer)
        self._dir = self.dirpath or run_folder(trainer)  # dumps go to hang/ in the run's one folder
        self._stop.clear()
        self.report, self._hang_found = None, False
        self._register_child_dumps()
        self._thread = threading.Thread(target=self._watch, name="lightning_accel-hang-sentinel", daemon=True)
        self._thread.start()

    def _register_child_dumps(self) -> None:
        self._child_dump: IO[bytes] | None = None
        if _CHILD_DUMP_SIGNAL is None:
            return
        self._child_dump = tempfile.TemporaryFile()  # unlinked; forked children share its offset, so dumps append
        # chain only to a handler of the user's: chaining to the default action would end each child after its dump
        chain = signal.getsignal(_CHILD_DUMP_SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        faulthandler.register(_CHILD_DUMP_SIGNAL, file=self._child_dump, all_threads=True, chain=chain)

    def _dump_children(self, folder: Path) -> None:
        """Ask this rank's child processes (loader workers) for their stacks, and copy them next to ours."""
        if self._child_dump is None:
            return
        children = _worker_processes()
        for child in children:
            try:
                os.kill(child.pid, _CHILD_DUMP_SIGNAL)
            except OSError:
                pass
        if not children:
            return
        _wait_until_quiet(self._child_dump)  # each child writes from its own signal handler, when it is scheduled
        self._child_dump.seek(0)
        text = self._child_dump.read().decode(errors="replace")
        pids = ", ".join(str(c.pid) for c in children)
        (folder / f"rank{self._rank}.children.stacks.txt").write_text(
            f"child processes of rank {self._rank} (pid {self._pid}): {pids}; each block below is one of them "
            "(a child started with the 'spawn' method has no dump handler and is ended by the signal instead)\n\n"
            + text
        )

    def _make_board(self, trainer: Trainer) -> Board:
        store = default_store() if trainer.world_size > 1 else None
        if store is None:
            return LocalBoard()
        try:
            store = store.clone()  # its own connection: the watchdog never queues behind the main thread
        except (AttributeError, RuntimeError, NotImplementedError):
            pass
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job must not read old beats
        prefix = f"lightning_accel/sentinel/{restart}/{self._fits}"
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or trainer.num_devices
        if local_world <= 1 or trainer.world_size % local_world:
            return StoreBoard(store, trainer.world_size, prefix=prefix)  # one rank a node: its own key
        # A node's ranks meet in a folder on the node and its leader alone talks to the store (monitor/node_board.py).
        # The folder's name is the job's: rank 0's token, which every rank reads (two jobs may share a node).
        token = store.compare_set(f"{prefix}/job", "", uuid.uuid4().hex)
        job = token.decode() if isinstance(token, bytes) else str(token)
        node = trainer.global_rank // local_world
        return NodeBoard(
            store,
            prefix,
            node_folder(Path(tempfile.gettempdir()), job, node),
            rank=trainer.global_rank,
            node=node,
            nodes=trainer.world_size // local_world,
            local_rank=trainer.global_rank % local_world,
            local_world=local_world,
            lead_takeover_s=self.takeover_s / (local_world + 1),  # a node changes leader before the job its judge
            verdict_every_s=VERDICT_EVERY_S,
        )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        check_loaders(trainer.train_dataloader)  # a first batch that can never come: an error now, not a hang later

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._enter("forward")

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        self._enter("backward")

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._enter("optimizer")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self._batches += 1
        last = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        self._finished("train", trainer, "finished" if last else "data")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._enter("finished")

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._since = time.monotonic()
        self._enter("validation")

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        self._finished("validation", trainer, "validation")

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._since = time.monotonic()  # the next training batch is timed from here, not from before validation
        self._enter("data")

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._leave_checkpoint()
        self._save_resume_phase = self._phase
        self._save_started = time.monotonic()
        self._enter("checkpoint")

    def _leave_checkpoint(self) -> None:
        """A save ends at the next event: its time is measured, and left out of the batch it interrupted."""
        if self._phase == "checkpoint":
            now = time.monotonic()
            self._allowance.record("save", now - self._save_started)
            self._since += now - self._save_started  # a save is not part of the batch it follows
            self._phase = self._save_resume_phase

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Lightning runs no teardown hook after an exception: a Preempted caught in a notebook must not leave a
        # watchdog behind that would take the kernel's silence for a hang
        self._let_the_watchdog_exit()
        self._stop_watching()

    def _let_the_watchdog_exit(self) -> None:
        """After a hang is found, the exit code is the sentinel's: when the other ranks' exit breaks this one's
        collective (gloo: "Connection closed by peer"), the main thread waits for the watchdog to end the process
        with :data:`HANG_EXIT_CODE` instead of raising a secondary error with another code."""
        if self._hang_found and self.exit_on_hang and self._thread is not None:
            self._thread.join()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._let_the_watchdog_exit()
            self._stop_watching()

    def _stop_watching(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5 * self.poll_s + 1)
        self._thread = None
        if self._phase == "finished" and not self._hang_found:
            try:  # the last word for the ranks still watching: finished, so its silence from now on is no hang
                self._board.publish(self.beat())
            except Exception as error:
                log.debug("HangSentinel: could not publish the finished beat (%s)", error)
        if not self._hang_found:  # (a rank that found a hang exits from the watchdog: its node's folder stays)
            try:
                self._board.leave()
            except OSError as error:
                log.debug("HangSentinel: could not tidy the node's folder (%s)", error)
        if self._child_dump is not None:
            faulthandler.unregister(_CHILD_DUMP_SIGNAL)
            self._child_dump.close()
            self._child_dump = None

    # -- the watchdog thread --------------------------------------------------------------------------------
    def _watch(self) -> None:
        # rank 0 judges every beat; the others read its verdict (O(W) store work a poll in all: heartbeat.Watch)
        watch = Watch(self._board, self._rank, self._world, takeover_s=self.takeover_s)
        failures = 0
        while not self._stop.wait(self.poll_s):
            try:
                report = watch.poll(self.beat())
                failures = 0
            except Exception as error:  # the store went away (a rank ended or died): nothing left to watch
                failures += 1
                if failures >= 3:
                    log.info("HangSentinel: the job's store stopped answering (%s); hang detection is off", error)
                    return
                continue
            if report is not None:
                self._act(report)
                return

    def _act(self, report: HangReport) -> None:
        self._hang_found = True
        folder = self._dir / "hang"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank{self._rank}.stacks.txt", "w") as out:
            out.write(
                f"rank {self._rank}, host {self._host}, pid {self._pid}, phase {self._phase}, "
                f"{self._batches} finished batches, global step {self._step}\n\n"
            )
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        self._dump_children(folder)
        recorder = nccl_flight_recorder_dump()
        if recorder is not None:
            (folder / f"rank{self._rank}.nccl_flight_recorder.pkl").write_bytes(recorder)
        if self._rank == min(b["rank"] for b in report.beats):
            (folder / "report.json").write_text(report.to_json())
        self.report = report  # once the stacks are on disk: what waits on it sees them taken at the hang
        log.error(
            "HangSentinel (rank %d): hang found: %s. Every rank's Python stacks are in %s%s",
            self._rank,
            report.describe(),
            folder,
            f"; exiting with code {HANG_EXIT_CODE} so the launcher can restart from the last checkpoint"
            if self.exit_on_hang
            else "",
        )
        if not self.exit_on_hang:
            return
        try:
            self._board.mark_dumped(self._rank)
            deadline = time.monotonic() + max(30.0, 10 * self.poll_s)
            while not self._board.all_dumped() and time.monotonic() < deadline:
                time.sleep(self.poll_s / 2)  # keep the store up (rank 0 may host it) until every rank has dumped
        except Exception:
            pass
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        # a loader worker stuck in user code never checks that its parent is gone: end it, or it lives on as an
        # orphan holding memory (and the launcher's output pipes)
        for child in _worker_processes():
            try:
                child.kill()
            except psutil.Error:
                pass
        os._exit(HANG_EXIT_CODE)  # the main thread is stuck: only a hard exit ends this process


def _wait_until_quiet(file: IO[bytes], quiet_s: float = 0.3, limit_s: float = 3.0) -> None:
    """Until ``file`` has not grown for ``quiet_s`` (and has something in it), or ``limit_s`` passed. A fixed wait cut
    a busy machine's child dumps short after their first line."""
    started = changed = time.monotonic()
    size = os.fstat(file.fileno()).st_size
    while time.monotonic() - started < limit_s and (size == 0 or time.monotonic() - changed < quiet_s):
        time.sleep(0.05)
        if (now := os.fstat(file.fileno()).st_size) != size:
            size, changed = now, time.monotonic()


def _worker_processes() -> list[psutil.Process]:
    """This process's multiprocessing children (loader workers) and theirs: the processes a hang dump asks for
    stacks and a hang exit ends. Other children (a server the user started with ``subprocess``) are left alone:
    the dump signal's default action would end them."""
    found = []
    for child in multiprocessing.active_children():
        try:
            process = psutil.Process(child.pid)
            found += [process, *process.children(recursive=True)]
        except psutil.Error:
            pass
    return found
