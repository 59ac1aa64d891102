"""Preemption-safe checkpointing: save on a signal at an optimizer-step boundary, periodic saves, keep-last-N."""

from __future__ import annotations

import logging
import random
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lightning_accel._compat import is_last_batch, saves_distributed_checkpoint
from lightning_accel.checkpoint.atomic import (
    RUN_ID_KEY,
    TMP_MARKER,
    AsyncAtomicCheckpointIO,
    AtomicCheckpointIO,
    manifest_path,
    read_manifest,
    verify,
)
from lightning_accel.checkpoint.resume import list_checkpoints
from lightning_accel.checkpoint.sharded import seal_folder

log = logging.getLogger(__name__)

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again". Schedulers and wrapper scripts can
# tell a preempted run (requeue it) from a crash (1) or success (0).
EXIT_CODE_PREEMPTED = 75

_RNG = dict[str, Any]


class Preempted(SystemExit):
    """Raised out of ``trainer.fit()`` right after a preemption checkpoint was written.

    A ``SystemExit`` whose ``code`` is the exit code (75), so a script ends with that status and no
    traceback; a notebook or a sweep catches it with ``except Preempted``. ``checkpoint`` is the file
    written (``None`` when the signal came before any training step, so there was nothing new to save).
    """

    def __init__(self, code: int, checkpoint: Path | None) -> None:
        super().__init__(code)
        self.checkpoint = checkpoint


def _rng_state() -> _RNG:
    # Only tensors and plain Python values, so checkpoints load with torch.load(weights_only=True).
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    state: _RNG = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: _RNG) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _is_stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _wrapped_stateful_sampler(loader: Any) -> bool:
    """A StatefulDataLoader whose own sampler Lightning wrapped for DDP (its order is lost on resume)."""
    if type(loader).__name__ != "StatefulDataLoader":
        return False
    samplers = (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None))
    return any(isinstance(s, DistributedSamplerWrapper) for s in samplers)


class PreemptionCheckpoint(Callback):
    """Save a full checkpoint when the job is told to stop, and periodically; exit with a distinct code.

    On one of ``signals`` the handler only raises a flag. Training continues to the next optimizer-step
    boundary (never inside a gradient-accumulation window), all ranks agree (any rank signalled), a
    checkpoint ``step=NNNNNNNN.ckpt`` is written, and :class:`Preempted` (``SystemExit(75)``) is raised
    out of ``trainer.fit()`` at once: no validation pass, no further batch. A signal during validation
    lets that validation finish first; one before the first training step exits without a new save.

    Periodic saves (``every_n_steps``, ``every_n_seconds``) also happen at optimizer-step boundaries
    only. Writes go through :class:`AtomicCheckpointIO` (temp file, fsync, rename, checksum manifest),
    in a background thread with ``async_save``. The callback state carries every rank's RNG state, so a
    resumed run reproduces the uninterrupted one bit for bit with a stateful train loader
    (:class:`ResumableDataLoader`, torchdata's ``StatefulDataLoader``, :class:`DALIImageDataModule`).
    While this callback is attached, validation does not advance the training RNG (its RNG state is
    saved before and restored after every validation run), because a resume skips a validation that
    was due right after the saved step. See docs/checkpointing.md for what is and is not guaranteed.

    Args:
        dirpath: Folder for the checkpoints (``find_resume_checkpoint(dirpath)`` resumes from it).
        signals: Signal names to handle. SIGUSR1 is left to Lightning's SLURM auto-requeue by default.
        every_n_steps: Also save every this many optimizer steps (``None``: off).
        every_n_seconds: Also save at the first step boundary this long after the last save.
        keep_last: Keep this many newest valid checkpoints of this run; older ones of this run are
            deleted (``None``: keep all). Files other runs wrote into the same folder are never touched.
        async_save: Write in a background thread; training only stalls for the tensor copy.
        exit_on_preempt: Raise :class:`Preempted` after a signal-triggered save. ``False``: set
            ``trainer.should_stop`` instead, so ``fit`` returns normally (Lightning then runs the
            validation it runs before any early stop).
        exit_code: Exit status of a preempted run.
        grace_period_s: Seconds between the signal and SIGKILL where this runs (30: torchrun's shutdown grace
            and Kubernetes' default ``terminationGracePeriodSeconds``; Slurm's ``--signal=SIGTERM@N`` gives N).
            Saves are timed to durability; the first one that would not fit warns, with the numbers and fixes.
    """

    def __init__(
        self,
        dirpath: str | Path = "checkpoints",
        signals: tuple[str, ...] | list[str] = ("SIGTERM",),
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        keep_last: int | None = 3,
        async_save: bool = False,
        exit_on_preempt: bool = True,
        exit_code: int = EXIT_CODE_PREEMPTED,
        grace_period_s: float = 30.0,
    ) -> None:
        self.dirpath = Path(dirpath)
        if grace_period_s <= 0:
            raise ValueError(f"grace_period_s must be positive, got {grace_period_s}")
        self.grace_period_s = grace_period_s
        self.save_seconds: list[float] = []  # each save, start to durable: the stall, plus the write when async
        self.signals = [self._signal(name) for name in signals]
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("every_n_seconds", every_n_seconds),
            ("keep_last", keep_last),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        self.every_n_steps = every_n_steps
        self.every_n_seconds = every_n_seconds
        self.keep_last = keep_last
        self.async_save = async_save
        self.exit_on_preempt = exit_on_preempt
        self.exit_code = exit_code
        self.preempted = False
        self.saved: list[Path] = []
        self.run_id = ""
        self._received: int | None = None
        self._chained: dict[int, Callable[[int, FrameType | None], Any]] = {}
        self._last_save = time.monotonic()
        self._step_at_batch_start = 0
        self._pending_rng: list[_RNG] | None = None
        self._validation_rng: _RNG | None = None
        self._deferred = False  # a save that fell on an epoch's last batch, done at the next step
        self._verified: dict[tuple[str, int, int], bool] = {}
        self._stall = 0.0  # the last save's time on the training thread
        self._async_write: int | None = None  # index in the IO's write_seconds of an async write not yet timed

    @staticmethod
    def _signal(name: str) -> signal.Signals:
        try:
            return signal.Signals[name] if isinstance(name, str) else signal.Signals(name)
        except (KeyError, ValueError) as err:
            raise ValueError(f"Unknown signal {name!r}; use names like 'SIGTERM' or 'SIGUSR1'") from err

    # -- lifecycle ----------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.preempted, self.saved, self._received, self._deferred = False, [], None, False
        self.save_seconds, self._async_write = [], None
        self.run_id = uuid.uuid4().hex  # replaced by the checkpoint's when this fit resumes
        self._verified.clear()
        strategy = trainer.strategy
        sharded = isinstance(strategy, DeepSpeedStrategy) or saves_distributed_checkpoint(strategy)
        if sharded and self.async_save:
            log.warning(
                "%s writes sharded checkpoint folders itself, synchronously: async_save=True applies to single-file "
                "checkpoints only. Folders are sealed with a manifest once every rank has written",
                type(strategy).__name__,
            )
        io = strategy.checkpoint_io
        if type(io) is TorchCheckpointIO:  # the default: upgrade it; a user's own plugin is respected
            strategy.checkpoint_io = AsyncAtomicCheckpointIO() if self.async_save else AtomicCheckpointIO()
        elif not isinstance(io, (AtomicCheckpointIO, AsyncCheckpointIO)):
            log.warning(
                "%s uses its own checkpoint IO (%s): writes are not made atomic by PreemptionCheckpoint",
                type(strategy).__name__,
                type(io).__name__,
            )
        # Handlers in place before Lightning installs its own (a user's, an agent's): ours call them.
        self._chained = {}
        for sig in self.signals:
            previous = signal.getsignal(sig)
            if callable(previous) and previous is not signal.default_int_handler:
                self._chained[sig] = previous
        if trainer.is_global_zero and self.dirpath.is_dir():
            for stale in self.dirpath.glob(f".*{TMP_MARKER}*"):  # left by a write that was killed
                stale.unlink(missing_ok=True)

    def _install_handlers(self) -> None:
        # Lightning's own SIGTERM handler (installed right before the sanity check) makes the loop raise
        # SIGTERMException (exit code 0) at the next batch, inside an accumulation window, after a
        # validation pass: ours replaces it for the fit and calls the handlers that were there before.
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn(
                "PreemptionCheckpoint: fit runs off the main thread, where Python cannot install signal "
                "handlers; periodic saves work, saves on a signal do not"
            )
            return
        for sig in self.signals:
            if signal.getsignal(sig) != self._handle:
                signal.signal(sig, self._handle)

    def _restore_handlers(self) -> None:
        # Only if ours is still installed: Lightning's teardown has usually put the original back already,
        # and putting back what we replaced would re-install Lightning's stale handler after fit.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, self._chained.get(sig, signal.SIG_DFL))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._received = signum  # only a flag: the next optimizer-step boundary decides what happens
        chained = self._chained.get(signum)
        if chained is not None:
            chained(signum, frame)

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install_handlers()
        self._stash_rng_for_validation()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install_handlers()
        self._last_save = time.monotonic()
        self._warn_if_loader_is_not_resumable(trainer)
        if trainer.strategy.reduce_boolean_decision(self._received is not None, all=False):  # any rank
            log.warning("received a stop signal before the first training step: nothing new to save, stopping")
            self._stop(trainer, None)

    def _warn_if_loader_is_not_resumable(self, trainer: Trainer) -> None:
        loaders = trainer.train_dataloader
        flat = (
            loaders.values()
            if isinstance(loaders, dict)
            else loaders
            if isinstance(loaders, (list, tuple))
            else [loaders]
        )
        for loader in flat:
            if loader is not None and _wrapped_stateful_sampler(loader):
                rank_zero_warn(
                    "PreemptionCheckpoint: under DDP, Lightning wrapped this StatefulDataLoader's own sampler in a "
                    "DistributedSamplerWrapper, which reshuffles from the global RNG at every epoch and keeps no "
                    "state, so the order after a resume differs from the uninterrupted run's. Build the loader in "
                    "train_dataloader() with `sampler=StatefulDistributedSampler(dataset, shuffle=True, seed=...)` "
                    "(from torchdata.stateful_dataloader.sampler); Lightning keeps a distributed sampler as it is."
                )
            if loader is not None and not _is_stateful(loader):
                rank_zero_warn(
                    f"PreemptionCheckpoint: the train loader ({type(loader).__name__}) has no state_dict, so a "
                    "resume from a mid-epoch checkpoint replays or skips samples and is not exact. Use "
                    "`from torchdata.stateful_dataloader import StatefulDataLoader` (same arguments as "
                    "DataLoader) or lightning_accel.ResumableDataLoader."
                )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore_handlers()
        if stage == "fit" and trainer.is_global_zero:
            # Writes still in flight at the last saves were skipped by pruning; Lightning has flushed
            # them by now (strategy teardown runs before this hook), so count them now.
            self._prune(trainer.strategy.checkpoint_io)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Also on Preempted: teardown hooks do not run after an exception.
        self._restore_handlers()
        if isinstance(exception, Preempted):
            if isinstance(trainer.strategy.checkpoint_io, AsyncAtomicCheckpointIO):
                trainer.strategy.checkpoint_io.wait()
                if trainer.is_global_zero:
                    self._prune(trainer.strategy.checkpoint_io)
            # No rank leaves before the checkpoint is complete: a restart must find the same newest file.
            trainer.strategy.barrier("PreemptionCheckpoint.preempted")

    # -- RNG ----------------------------------------------------------------------------------------
    # Validation runs with the RNG state of the end of the batch before it, and hands that state back:
    # the validation loader's iterator (created before on_validation_start) and validation_step draw
    # from it. Taken at every batch end, since whether validation follows is Lightning's private decision.
    def _stash_rng_for_validation(self) -> None:
        self._validation_rng = _rng_state()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self._validation_rng is not None:
            _set_rng_state(self._validation_rng)

    # -- saving -------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step
        if self._pending_rng is not None:
            # Restored here, not at load time: the resumed loader's iterator draws from the RNG.
            states, self._pending_rng = self._pending_rng, None
            _set_rng_state(states[trainer.global_rank] if trainer.global_rank < len(states) else states[0])

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.enable_validation:  # off the hot path of runs without validation
            self._stash_rng_for_validation()
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncAtomicCheckpointIO):
            io.raise_if_failed()  # a failed background write (a full disk) stops training now
            self._time_finished_write(io)
        if trainer.global_step == self._step_at_batch_start:
            return  # inside an accumulation window: a checkpoint here would hold half of it
        signalled = trainer.strategy.reduce_boolean_decision(self._received is not None, all=False)
        due = self.every_n_steps is not None and trainer.global_step % self.every_n_steps == 0
        if self.every_n_seconds is not None:
            elapsed = time.monotonic() - self._last_save >= self.every_n_seconds
            due = due or trainer.strategy.broadcast(elapsed, src=0)  # rank 0's clock decides for all
        if not (signalled or due or self._deferred):
            return
        if is_last_batch(trainer) and not self._is_final_step(trainer):
            # Never at an epoch's last batch: Lightning does not hand stateful loaders their state back
            # when resuming there (a DALI or StatefulDataLoader epoch then starts over from its first
            # order), and resumes such a checkpoint inconsistently. The next epoch's first step is safe.
            self._deferred = True
            return
        self._deferred = False
        self._save_or_stop(trainer, signalled)

    def _time_finished_write(self, io: AsyncAtomicCheckpointIO) -> None:
        if self._async_write is not None and len(io.write_seconds) > self._async_write:
            self._timed(self._stall + io.write_seconds[self._async_write])
            self._async_write = None

    def _timed(self, seconds: float) -> None:
        self.save_seconds.append(seconds)
        if len(self.save_seconds) > 1 or seconds <= self.grace_period_s:
            return
        rank_zero_warn(
            f"PreemptionCheckpoint: a save took {seconds:.1f} s from start to durable, over the "
            f"{self.grace_period_s:g} s grace period between a preemption signal and SIGKILL "
            "(grace_period_s): a save at the signal would be cut off, and the run would resume from the "
            "previous checkpoint (writes are atomic: it stays valid). Fixes: a faster disk for dirpath; "
            "more frequent periodic saves (every_n_steps / every_n_seconds; async_save=True keeps them from "
            "stalling training) so that less is lost; a longer grace period where you can set one (Kubernetes "
            "terminationGracePeriodSeconds, Slurm --signal=SIGTERM@<seconds>)."
        )

    @staticmethod
    def _is_final_step(trainer: Trainer) -> bool:
        # No later step to move the save to: the last step of the whole run is saved where it is.
        by_steps = trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
        by_epochs = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
        return by_steps or by_epochs

    def _save_or_stop(self, trainer: Trainer, signalled: bool) -> None:
        if not signalled:
            self.save(trainer)
            return
        name = signal.Signals(self._received).name if self._received else "a peer rank's signal"
        log.warning("received %s: saving a checkpoint at step %d and stopping", name, trainer.global_step)
        self._stop(trainer, self.save(trainer))

    def _stop(self, trainer: Trainer, checkpoint: Path | None) -> None:
        self.preempted = True
        if not self.exit_on_preempt:
            trainer.should_stop = True
            return
        log.info(
            "preempted: %s, exiting with code %d",
            f"saved {checkpoint}" if checkpoint else "nothing to save",
            self.exit_code,
        )
        raise Preempted(self.exit_code, checkpoint)

    def save(self, trainer: Trainer) -> Path:
        """Write ``step=NNNNNNNN.ckpt`` now (all ranks must call this), then prune old checkpoints."""
        path = self.dirpath / f"step={trainer.global_step:08d}.ckpt"
        if self.saved and self.saved[-1] == path:
            return path  # already saved at this step (periodic save, then a signal)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncAtomicCheckpointIO):
            io.wait()  # (the save waits for the previous write anyway) so this save's write comes next
            self._time_finished_write(io)
            self._async_write = len(io.write_seconds)
        start = time.monotonic()
        trainer.save_checkpoint(path, weights_only=False)  # ends with a barrier: every rank has written
        if trainer.is_global_zero and path.is_dir():  # a sharded folder (torch DCP, DeepSpeed): seal it
            seal_folder(path, {"global_step": trainer.global_step, "run_id": self.run_id})
        self._stall = time.monotonic() - start
        if not isinstance(io, AsyncAtomicCheckpointIO):
            self._timed(self._stall)  # an async save is timed when its write has finished
        self.saved.append(path)
        self._last_save = time.monotonic()
        if trainer.is_global_zero:
            self._prune(trainer.strategy.checkpoint_io)
        return path

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[RUN_ID_KEY] = self.run_id

    def _is_kept_valid(self, path: Path, io: Any = None) -> bool:
        # Each kept file is checked once (cached by size and mtime), so a corrupted newest file of the
        # right size never pushes out the good ones; deleting only follows a full check. A file our own IO
        # wrote, unchanged since, was checksummed from the bytes written: no second read of it.
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in self._verified and isinstance(io, AtomicCheckpointIO) and io.wrote(path):
            self._verified[key] = True
        if key not in self._verified:
            verdict = verify(path)
            if not verdict:
                log.warning("checkpoint %s does not count towards keep_last: %s", path, verdict.reason)
            self._verified[key] = bool(verdict)
        return self._verified[key]

    def _prune(self, io: Any = None) -> None:
        if self.keep_last is None:
            return
        io = getattr(io, "checkpoint_io", io)  # ours inside Lightning's AsyncCheckpointIO too
        # Only this run's complete checkpoints count, so a write still in flight (async) never pushes
        # out the last good one and another run's files in a shared folder are never touched. Complete
        # means a manifest is there (an async write renames the file before it writes the manifest).
        ours = [
            p
            for p in list_checkpoints(self.dirpath, "step=*.ckpt")
            if (read_manifest(p) or {}).get("run_id") == self.run_id
        ]
        kept = 0
        for path in ours:
            if kept < self.keep_last:
                kept += self._is_kept_valid(path, io)
                continue
            if isinstance(io, AtomicCheckpointIO):
                io.remove_checkpoint(path)  # async: queued behind the write in flight, off the training thread
            else:  # a checkpoint IO of the user's
                if path.is_dir():  # a sharded folder
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                manifest_path(path).unlink(missing_ok=True)

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Called on every rank while the checkpoint is assembled, so a collective is safe here.
        state = _rng_state()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)
        else:
            states = [state]
        return {"rng_states": states, "run_id": self.run_id}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_rng = state_dict.get("rng_states")
        self.run_id = state_dict.get("run_id") or self.run_id
