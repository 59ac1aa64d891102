"""Preemption-safe checkpointing: save on a signal at an optimizer-step boundary, periodic saves, keep-last-N."""

from __future__ import annotations

import logging
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel._compat import (
    is_last_batch,
    log_current_train_batch,
    run_due_validation,
    validation_due_after_this_batch,
)
from lightning_accel.checkpoint.async_io import AsyncAtomicCheckpointIO, install_atomic_io
from lightning_accel.checkpoint.destination import Destination
from lightning_accel.checkpoint.durable import RUN_ID_KEY
from lightning_accel.checkpoint.epoch_state import (
    EpochState,
    PendingResults,
    capture_epoch_state,
    restore_metric_states,
    warn_about_unsaved_metrics,
)
from lightning_accel.checkpoint.loader_state import (
    warn_if_epoch_order_is_lost,
    warn_if_not_resumable,
)
from lightning_accel.checkpoint.resumed_run import ResumedRun, is_final_step
from lightning_accel.checkpoint.retention import KeepLast
from lightning_accel.checkpoint.rng import RNGState, capture_rng, gather_rng_states, restore_rng, rng_for_rank
from lightning_accel.checkpoint.save_timing import SaveTimer
from lightning_accel.checkpoint.sharded import seal_folder, writes_folders
from lightning_accel.checkpoint.signals import PREEMPTED_EXIT_CODE, Preempted, StopSignals
from lightning_accel.ranks import gather_from_ranks
from lightning_accel.storage.shards import shard_digests

__all__ = ["EPOCH_STATE_KEY", "VALIDATION_DUE_KEY", "PreemptionCheckpoint"]

log = logging.getLogger(__name__)

EPOCH_STATE_KEY = "lightning_accel_epoch_state"  # every rank's running epoch aggregates (epoch_state.py)
VALIDATION_DUE_KEY = "lightning_accel_validation_due"  # validation was due right after the saved batch


class PreemptionCheckpoint(Callback):
    """Save a full checkpoint when the job is told to stop, and periodically; exit with a distinct code.

    On one of ``signals`` the handler only raises a flag. Training continues to the next optimizer-step boundary
    (never inside a gradient-accumulation window), all ranks agree (any rank signalled), a checkpoint
    ``step=NNNNNNNN.ckpt`` is written, and :class:`Preempted` (``SystemExit(75)``) is raised out of
    ``trainer.fit()`` at once: no validation pass, no further batch. A signal during validation lets that validation
    finish first; one before the first training step exits without a new save.

    Periodic saves (``every_n_steps``, ``every_n_seconds``) also happen at optimizer-step boundaries only. Writes go
    through :class:`AtomicCheckpointIO` (temp file, fsync, rename, checksum manifest), in a background thread with
    ``async_save``. The checkpoint carries every rank's RNG state and the interrupted epoch's running logged values
    and torchmetrics states, so a resumed run reproduces the uninterrupted one bit for bit (weights and epoch
    values) with a stateful train loader (:class:`ResumableDataLoader`, torchdata's ``StatefulDataLoader``,
    :class:`DALIImageDataModule`). A validation that was due right after the saved step runs first on resume. While
    this callback is attached, validation does not advance the training RNG (its RNG state is saved before and
    restored after every validation run). See docs/checkpointing.md for what is and is not guaranteed.

    ``dirpath`` may be a bucket URL (``s3://``, ``gs://``, ``az://``): checkpoints are staged locally and uploaded in
    the background, manifest last (docs/checkpointing.md, "Checkpoints in a bucket"; :class:`Destination`).

    Args:
        dirpath: Folder or bucket URL for the checkpoints (``find_resume_checkpoint(dirpath)`` resumes from it).
        signals: Signal names to handle. SIGUSR1 is left to Lightning's SLURM auto-requeue by default.
        every_n_steps: Also save every this many optimizer steps (``None``: off).
        every_n_seconds: Also save at the first step boundary this long after the last save.
        keep_last: Keep this many newest valid checkpoints of this run; older ones of this run are deleted
            (``None``: keep all). Files other runs wrote into the same folder are never touched.
        async_save: Write in a background thread; training only stalls for the tensor copy.
        exit_on_preempt: Raise :class:`Preempted` after a signal-triggered save. ``False``: set ``trainer.should_stop``
            instead, so ``fit`` returns normally (Lightning then runs the validation it runs before any early stop).
        exit_code: Exit status of a preempted run.
        grace_period_s: Seconds between the signal and SIGKILL where this runs (30: torchrun's shutdown grace and
            Kubernetes' default ``terminationGracePeriodSeconds``; Slurm's ``--signal=SIGTERM@N`` gives N). Saves are
            timed to durability; the first one that would not fit warns, with the numbers and fixes.
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
        exit_code: int = PREEMPTED_EXIT_CODE,
        grace_period_s: float = 30.0,
    ) -> None:
        self.destination = Destination(dirpath)  # a bad URL is refused here, before any training
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("every_n_seconds", every_n_seconds),
            ("keep_last", keep_last),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        self.stop_signals = StopSignals(signals)
        self.save_timer = SaveTimer(grace_period_s)
        self.every_n_steps = every_n_steps
        self.every_n_seconds = every_n_seconds
        self.retention = KeepLast(keep_last)
        self.async_save = async_save
        self.exit_on_preempt = exit_on_preempt
        self.exit_code = exit_code
        self.preempted = False
        self.saved: list[Path] = []  # written (to the local staging folder, with a bucket dirpath)
        self.run_id = ""
        self._last_save = time.monotonic()
        self._step_at_batch_start = 0
        self._pending_rng: list[RNGState] | None = None
        self._validation_rng: RNGState | None = None
        self._deferred = False  # a save that fell on an epoch's last batch, done at the next step
        self.resumed = ResumedRun()  # the shape of the run this fit resumes, followed or refused; a finished run
        self._pending_epoch_state: list[EpochState] | None = None  # every rank's, until the first resumed batch
        self._pending_results: PendingResults | None = None  # logged values not yet folded into the resumed epoch
        self._validation_due = False  # after the batch being saved by save(); after the one resumed from, on load

    @property
    def signals(self) -> list[signal.Signals]:
        return self.stop_signals.signals

    @property
    def keep_last(self) -> int | None:
        return self.retention.keep_last

    @property
    def grace_period_s(self) -> float:
        return self.save_timer.grace_period_s

    @property
    def dirpath(self) -> str | Path:  # the folder (a Path) or bucket URL (a str) as given
        return self.destination.dirpath

    @property
    def local_dir(self) -> Path:  # where checkpoints are written here: dirpath, or a bucket URL's staging folder
        return self.destination.local_dir

    @property
    def durable(self) -> list[str]:
        """URLs of this fit's checkpoints confirmed in the store (bucket ``dirpath``; empty otherwise), oldest first."""
        return self.destination.durable

    @property
    def save_seconds(self) -> list[float]:
        """Each save, start to durable: the stall, plus the write when async."""
        return self.save_timer.seconds

    def request_stop(self, reason: str) -> None:
        """Stop as at a signal (from any thread): save at the next safe point, exit 75; ``reason`` names it in logs."""
        self.stop_signals.request(reason)

    def limit_grace(self, seconds: float) -> None:
        """Saves must be durable within ``seconds`` (a notice's lead, say): the first save over it warns."""
        self.save_timer.grace_period_s = min(self.save_timer.grace_period_s, seconds)

    # -- lifecycle ----------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.preempted, self.saved, self._deferred = False, [], False
        self.save_timer.reset()
        self.stop_signals.reset()
        self.resumed.reset(trainer)
        self._pending_epoch_state, self._pending_results, self._validation_due = None, None, False
        self.run_id = trainer.strategy.broadcast(uuid.uuid4().hex, src=0)  # rank 0's; a resume loads the checkpoint's
        self.retention.reset()
        install_atomic_io(trainer.strategy, self.async_save, fsync=self.destination.url is None)  # bucket: no fsync
        # Handlers in place before Lightning installs its own (a user's, an agent's): ours call them.
        self.stop_signals.remember_previous()
        self.destination.check_writable(trainer, self.run_id, self.keep_last, self.grace_period_s)

    def _install_handlers(self, trainer: Trainer) -> None:
        # Lightning's SIGTERM handler (installed right before the sanity check) makes the loop raise SIGTERMException
        # (exit 0) at the next batch, inside an accumulation window: ours replaces it and calls the ones there before.
        if not self.stop_signals.install_for_fit(trainer):
            rank_zero_warn(
                "PreemptionCheckpoint: fit runs off the main thread, where Python cannot install signal "
                "handlers; periodic saves work, saves on a signal do not"
            )

    @override
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install_handlers(trainer)
        self._stash_rng_for_validation()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install_handlers(trainer)
        if self._validation_due:
            self._run_due_validation(trainer)
        self._last_save = time.monotonic()
        warn_if_not_resumable(trainer.train_dataloader)
        if self._pending_rng is not None:  # resuming
            warn_if_epoch_order_is_lost(trainer.train_dataloader, trainer.current_epoch)
        self.resumed.train_starts(trainer)  # a changed world size or per-device batch: followed, or refused now
        warn_about_unsaved_metrics(pl_module)
        if trainer.strategy.reduce_boolean_decision(self.stop_signals.received is not None, all=False):  # any rank
            log.warning("received a stop signal before the first training step: nothing new to save, stopping")
            self._stop(trainer, None)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.resumed.fit_ends(trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.stop_signals.restore()
        if stage == "fit" and self.stop_signals.received is not None and not self.preempted:
            log.warning(
                "received %s after the last training step: training is complete, fit() returns normally",
                self.stop_signals.name(),
            )
        if stage == "fit" and trainer.is_global_zero:
            # Writes still in flight at the last saves were skipped by pruning; Lightning has flushed
            # them by now (strategy teardown runs before this hook), so count them now.
            self._prune(trainer.strategy.checkpoint_io)
            self.destination.finish()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Also on Preempted: teardown hooks do not run after an exception, and Lightning's teardown follows this hook.
        self.stop_signals.restore_after_fit(trainer)
        if isinstance(exception, Preempted):
            if isinstance(trainer.strategy.checkpoint_io, AsyncAtomicCheckpointIO):
                trainer.strategy.checkpoint_io.wait()
                self.save_timer.record_finished_write()
                if trainer.is_global_zero:
                    self._prune(trainer.strategy.checkpoint_io)
            # No rank leaves before the checkpoint is complete: a restart must find the same newest file.
            trainer.strategy.barrier("PreemptionCheckpoint.preempted")
            self.destination.close(cancel=True)  # what was to reach the store has (_stop waited, to the deadline)
        elif trainer.is_global_zero:
            self.destination.finish()  # the checkpoints written before the error still reach the store

    # -- RNG ----------------------------------------------------------------------------------------
    # Validation runs with the RNG state of the end of the batch before it, and hands that state back: the validation
    # loader's iterator (created before on_validation_start) and validation_step draw from it. Taken at every batch
    # end, since whether validation follows is Lightning's private decision.
    def _stash_rng_for_validation(self) -> None:
        self._validation_rng = capture_rng()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self._validation_rng is not None:
            restore_rng(self._validation_rng)

    # -- saving -------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step
        if self._pending_rng is not None:
            # Restored here, not at load time: the resumed loader's iterator draws from the RNG.
            states, self._pending_rng = self._pending_rng, None
            restore_rng(rng_for_rank(states, trainer.global_rank))
        if self._pending_epoch_state is not None:
            epoch_states, self._pending_epoch_state = self._pending_epoch_state, None
            if len(epoch_states) == trainer.world_size:  # else per-rank values do not map (warned at train start)
                state = epoch_states[trainer.global_rank]
                restore_metric_states(pl_module, state)
                self._pending_results = PendingResults(state.get("results", {}))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._pending_results is not None:  # the first resumed batches: fold in the interrupted epoch's values
            self._pending_results.merge(trainer)
            if not self._pending_results.saved:
                self._pending_results = None
        if trainer.enable_validation:  # off the hot path of runs without validation
            self._stash_rng_for_validation()
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncAtomicCheckpointIO):
            io.raise_if_failed()  # a failed background write (a full disk) stops training now
            self.save_timer.record_finished_write()
        if trainer.global_step == self._step_at_batch_start:
            return  # inside an accumulation window: a checkpoint here would hold half of it
        signalled = trainer.strategy.reduce_boolean_decision(self.stop_signals.received is not None, all=False)
        due = self.every_n_steps is not None and trainer.global_step % self.every_n_steps == 0
        if self.every_n_seconds is not None:
            elapsed = time.monotonic() - self._last_save >= self.every_n_seconds
            due = due or trainer.strategy.broadcast(elapsed, src=0)  # rank 0's clock decides for all
        # The fit's last step is saved too, here where a resume is exact (at on_train_end Lightning has already closed
        # the epoch): the same command run again then finds a finished run instead of retraining the steps since.
        last_batch, ending = is_last_batch(trainer), is_final_step(trainer)
        final = ending and (trainer.global_step == trainer.max_steps or last_batch)
        if not (signalled or due or self._deferred or final):
            return
        if last_batch and not ending:
            # Never at an epoch's last batch: Lightning does not hand stateful loaders their state back
            # when resuming there (a DALI or StatefulDataLoader epoch then starts over from its first
            # order), and resumes such a checkpoint inconsistently. The next epoch's first step is safe.
            self._deferred = True
            return
        self._deferred = False
        self._save_or_stop(trainer, signalled)

    def _run_due_validation(self, trainer: Trainer) -> None:
        # The validation the interrupted attempt skipped (or ran, then died) right after the saved batch runs first,
        # with that batch's RNG state, so EarlyStopping, ReduceLROnPlateau and checkpoints on a validation metric
        # see the uninterrupted run's sequence of validations.
        self._validation_due = False
        if not trainer.enable_validation or self._pending_rng is None:
            return
        restore_rng(rng_for_rank(self._pending_rng, trainer.global_rank))
        self._stash_rng_for_validation()
        log.info("running the validation that was due after step %d before training on", trainer.global_step)
        run_due_validation(trainer)

    def _save_or_stop(self, trainer: Trainer, signalled: bool) -> None:
        if not signalled:
            self.save(trainer)
            return
        log.warning(
            "received %s: saving a checkpoint at step %d and stopping", self.stop_signals.name(), trainer.global_step
        )
        self._stop(trainer, self.save(trainer))

    def _stop(self, trainer: Trainer, checkpoint: Path | None) -> None:
        self.preempted = True
        if not self.exit_on_preempt:
            trainer.should_stop = True
            return
        if checkpoint is not None:  # stopping after a training batch: its logged values reach the loggers first
            log_current_train_batch(trainer)
        if self.destination.url is not None:  # rank 0 waits for the upload to the deadline; every rank names it
            began = self.stop_signals.received_at or time.monotonic()
            checkpoint = trainer.strategy.broadcast(
                self.destination.upload_before_deadline(began, self.grace_period_s), src=0
            )
        log.info(
            "preempted: %s, exiting with code %d",
            f"saved {checkpoint}" if checkpoint else "nothing to save",
            self.exit_code,
        )
        raise Preempted(self.exit_code, checkpoint)

    def save(self, trainer: Trainer) -> Path:
        """Write ``step=NNNNNNNN.ckpt`` now (all ranks must call this), then prune old checkpoints; with a bucket
        ``dirpath``, queue it for upload (rank 0)."""
        path = self.local_dir / f"step={trainer.global_step:08d}.ckpt"
        if self.saved and self.saved[-1] == path:
            return path  # already saved at this step (periodic save, then a signal)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncAtomicCheckpointIO):
            io.wait()  # (the save waits for the previous write anyway) so the previous one is timed first
            self.save_timer.record_finished_write()
        start = time.monotonic()
        self._validation_due = validation_due_after_this_batch(trainer)  # (written by on_save_checkpoint)
        try:
            trainer.save_checkpoint(path, weights_only=False)
        finally:
            self._validation_due = False  # ends with a barrier: every rank has written
        if writes_folders(trainer.strategy):  # a folder of shards: each rank's digests, sealed by rank 0
            digests = {
                k: v for part in gather_from_ranks(shard_digests(path, trainer.global_rank)) for k, v in part.items()
            }
            if trainer.is_global_zero:
                seal_folder(path, {"global_step": trainer.global_step, "run_id": self.run_id}, digests)
        write = io.last_write if isinstance(io, AsyncAtomicCheckpointIO) else None
        if write is not None:
            self.save_timer.wait_for(start, write)
        else:
            self.save_timer.record(time.monotonic() - start)
        self.destination.published(path, trainer.global_step, write, time.monotonic() - start)
        self.saved.append(path)
        self._last_save = time.monotonic()
        if trainer.is_global_zero:
            self._prune(trainer.strategy.checkpoint_io)
        return path

    def _prune(self, io: Any = None) -> None:
        if self.destination.url is None:  # a bucket's retention is its publisher's, once each upload is confirmed
            self.retention.prune(self.local_dir, self.run_id, io)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending_results is not None:
            self._pending_results.warn_unmerged()
            self._pending_results = None

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # On every rank, while the checkpoint is assembled: the gather is a collective all ranks reach.
        checkpoint[RUN_ID_KEY] = self.run_id
        checkpoint[EPOCH_STATE_KEY] = gather_from_ranks(capture_epoch_state(trainer, pl_module))
        checkpoint[VALIDATION_DUE_KEY] = self._validation_due  # True only in save(), at a training batch's end
        self.resumed.record(trainer, checkpoint)

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._pending_epoch_state = checkpoint.get(EPOCH_STATE_KEY)
        self._validation_due = bool(checkpoint.get(VALIDATION_DUE_KEY, False))
        self.resumed.loaded(trainer, checkpoint, self.state_key)  # before the loops load

    # -- state --------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        # Called on every rank while the checkpoint is assembled, so a collective is safe here.
        states = gather_rng_states()
        return {"rng_states": states, "run_id": self.run_id, "world_size": len(states)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_rng = state_dict.get("rng_states")
        self.run_id = state_dict.get("run_id") or self.run_id
