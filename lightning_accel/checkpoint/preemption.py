"""Preemption-safe checkpointing: save on a signal at a step boundary, periodic saves, keep-last-N."""

from __future__ import annotations

import logging
import random
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DeepSpeedStrategy

from lightning_accel.checkpoint.atomic import TMP_MARKER, AtomicCheckpointIO, manifest_path, read_manifest, verify
from lightning_accel.checkpoint.resume import list_checkpoints

log = logging.getLogger(__name__)

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again". Schedulers and wrapper scripts can
# tell a preempted run (requeue it) from a crash (1) or success (0).
EXIT_CODE_PREEMPTED = 75


def _rng_state() -> dict[str, Any]:
    # Only tensors and plain Python values, so checkpoints load with torch.load(weights_only=True).
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    state: dict[str, Any] = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class PreemptionCheckpoint(Callback):
    """Save a full checkpoint when the job is told to stop, and periodically; exit with a distinct code.

    On one of ``signals`` the handler only raises a flag; the current training step finishes, all ranks
    agree (any rank signalled), a checkpoint ``step=NNNNNNNN.ckpt`` is written, and the process exits
    with ``exit_code`` once Lightning has torn down. Writes go through :class:`AtomicCheckpointIO`
    (temp file, fsync, rename, checksum manifest), optionally in a background thread (``async_save``).
    The callback state carries every rank's RNG state, restored right before the first resumed step, so
    a resumed run reproduces the uninterrupted one bit for bit (with a :class:`ResumableDataLoader`).

    Args:
        dirpath: Folder for the checkpoints (``find_resume_checkpoint(dirpath)`` resumes from it).
        signals: Signal names to handle. SIGUSR1 is left to Lightning's SLURM auto-requeue by default.
        every_n_steps: Also save every this many optimizer steps (``None``: off).
        every_n_seconds: Also save when this much wall-clock time has passed since the last save.
        keep_last: Keep this many newest valid checkpoints; older ones are deleted (``None``: keep all).
        async_save: Write in a background thread; training only stalls for the tensor copy.
        exit_on_preempt: Raise ``SystemExit(exit_code)`` after a signal-triggered save.
        exit_code: Exit status of a preempted run.
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
    ) -> None:
        self.dirpath = Path(dirpath)
        self.signals = [self._signal(name) for name in signals]
        for name, value in (("every_n_steps", every_n_steps), ("every_n_seconds", every_n_seconds), ("keep_last", keep_last)):
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
        self._received: int | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._last_save = time.monotonic()
        self._pending_rng: list[dict[str, Any]] | None = None

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
        strategy = trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy) or getattr(strategy, "_save_distributed_checkpoint", False):
            log.warning(
                "%s saves a sharded checkpoint folder with its own writer: PreemptionCheckpoint still saves on "
                "signals and schedules, but atomic writes, manifests and find_resume_checkpoint cover "
                "single-file checkpoints only", type(strategy).__name__,
            )
        io = strategy.checkpoint_io
        if type(io) is TorchCheckpointIO:  # the default: upgrade it; a user's own plugin is respected
            atomic = AtomicCheckpointIO()
            strategy.checkpoint_io = AsyncCheckpointIO(atomic) if self.async_save else atomic
        elif not isinstance(io, (AtomicCheckpointIO, AsyncCheckpointIO)):
            log.warning(
                "%s uses its own checkpoint IO (%s): writes are not made atomic by PreemptionCheckpoint",
                type(strategy).__name__, type(io).__name__,
            )
        if trainer.is_global_zero and self.dirpath.is_dir():
            for stale in self.dirpath.glob(f".*{TMP_MARKER}*"):  # left by a write that was killed
                stale.unlink(missing_ok=True)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning installs its own handlers just before training starts; ours go on top of them and
        # are removed at teardown.
        self._received = None
        for sig in self.signals:
            self._previous_handlers[sig] = signal.signal(sig, self._handle)
        self._last_save = time.monotonic()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._received = signum  # only a flag: the step boundary decides what happens

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers.clear()
        if stage == "fit" and trainer.is_global_zero:
            # Async writes still queued at the last saves were skipped by pruning; Lightning has
            # flushed them by now (strategy teardown runs before this hook), so count them now.
            self._prune()
        if stage == "fit" and self.preempted and self.exit_on_preempt:
            log.info("preempted: checkpoint saved, exiting with code %d", self.exit_code)
            if dist.is_available() and dist.is_initialized():
                # Shut the process group down ourselves: left to interpreter exit, gloo's threads can
                # abort the process and replace our exit code with SIGABRT.
                dist.barrier()
                dist.destroy_process_group()
            raise SystemExit(self.exit_code)

    # -- saving -------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._pending_rng is not None:
            # Restored here, not at load time: loader iterators created on resume draw from the RNG.
            states, self._pending_rng = self._pending_rng, None
            _set_rng_state(states[trainer.global_rank] if trainer.global_rank < len(states) else states[0])

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        signalled = trainer.strategy.reduce_boolean_decision(self._received is not None, all=False)
        if signalled:
            name = signal.Signals(self._received).name if self._received else "a peer rank's signal"
            log.warning("received %s: saving a checkpoint at step %d and stopping", name, trainer.global_step)
            self.save(trainer)
            self.preempted = True
            trainer.should_stop = True
            return
        due = self.every_n_steps is not None and trainer.global_step % self.every_n_steps == 0
        if self.every_n_seconds is not None:
            elapsed = time.monotonic() - self._last_save >= self.every_n_seconds
            due = due or trainer.strategy.broadcast(elapsed, src=0)  # rank 0's clock decides for all
        if due and trainer.global_step > 0:
            self.save(trainer)

    def save(self, trainer: Trainer) -> Path:
        """Write ``step=NNNNNNNN.ckpt`` now (all ranks must call this), then prune old checkpoints."""
        path = self.dirpath / f"step={trainer.global_step:08d}.ckpt"
        if self.saved and self.saved[-1] == path:
            return path  # already saved at this step (periodic save, then a signal)
        trainer.save_checkpoint(path, weights_only=False)
        self.saved.append(path)
        self._last_save = time.monotonic()
        if trainer.is_global_zero:
            self._prune()
        return path

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        # Only complete checkpoints count, so a write still in flight (async) never pushes out the
        # last good one; it is counted at the next save. Complete means a manifest is there: an async
        # write renames the file into place before it writes the manifest, and such a file has no
        # recorded step, so it would sort as the oldest and be deleted. Size against the manifest is
        # enough here (hashing every kept file on the training thread would stall it); resume checks
        # the hash.
        valid = [
            p for p in list_checkpoints(self.dirpath, "step=*.ckpt")
            if read_manifest(p) is not None and verify(p, checksum=False) is None
        ]
        for old in valid[self.keep_last :]:
            old.unlink(missing_ok=True)
            manifest_path(old).unlink(missing_ok=True)

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Called on every rank while the checkpoint is assembled, so a collective is safe here.
        state = _rng_state()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)
        else:
            states = [state]
        return {"rng_states": states, "saved": [str(p) for p in self.saved]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_rng = state_dict.get("rng_states")
