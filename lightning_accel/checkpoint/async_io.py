"""Background checkpoint writes: a point-in-time copy on the training thread, the durable write off it.

Each write is an :class:`AsyncWrite` handle that carries its own timing, so a caller can ask how long a save
took from its start to durable on disk without bookkeeping of its own.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import Strategy
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_accel.checkpoint.atomic import AtomicCheckpointIO
from lightning_accel.checkpoint.durable import PathLike
from lightning_accel.checkpoint.sharded import writes_folders

__all__ = ["AsyncAtomicCheckpointIO", "AsyncWrite", "StagingBuffers", "install_atomic_io"]

log = logging.getLogger(__name__)


def _copyable(t: torch.Tensor) -> bool:
    # plain dense tensors; a tensor subclass (DTensor, ...) or a sparse one is cloned as it is
    return type(t) is torch.Tensor and t.layout == torch.strided and not t.is_meta


class StagingBuffers:
    """Point-in-time copies of a checkpoint's tensors into host buffers kept from one save to the next.

    A fresh copy of every tensor (``clone``, what Lightning's ``AsyncCheckpointIO`` does) pays for new pages
    on each save (the page faults of a checkpoint-sized allocation). Copying into the same buffers again costs the
    memcpy only. Buffers are matched by the tensor's position in the checkpoint and its shape and dtype, so
    a checkpoint whose layout changes gets new ones. CUDA tensors go to pinned buffers with non-blocking
    copies: the training thread only queues them, and :meth:`stage` returns an event the writer waits on
    (later kernels on the same stream run after the copies, so the snapshot is still point-in-time).
    """

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def stage(self, checkpoint: Any) -> tuple[Any, torch.cuda.Event | None]:
        position = itertools.count()
        kept: dict[int, torch.Tensor] = {}
        on_cuda = False

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal on_cuda
            index, tensor = next(position), tensor.detach()
            if not _copyable(tensor):
                return tensor.clone()
            buffer = self._buffers.get(index)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
            kept[index] = buffer
            buffer.copy_(tensor, non_blocking=tensor.is_cuda)
            on_cuda |= tensor.is_cuda
            return buffer

        staged = apply_to_collection(checkpoint, torch.Tensor, copy)
        self._buffers = kept
        if not on_cuda:
            return staged, None
        ready = torch.cuda.Event()
        ready.record()
        return staged, ready

    def clear(self) -> None:
        self._buffers = {}


@dataclass
class AsyncWrite:
    """One background write: ``done`` once it is durable (or failed); ``seconds`` from submit to durable."""

    path: Path
    submitted: float = field(default_factory=time.monotonic)
    finished: float | None = None
    future: Future[None] | None = None

    @property
    def done(self) -> bool:
        return self.future is not None and self.future.done()

    @property
    def seconds(self) -> float | None:
        """Submit to durable on disk; ``None`` until the write has succeeded."""
        return None if self.finished is None else self.finished - self.submitted


class AsyncAtomicCheckpointIO(AtomicCheckpointIO):
    """:class:`AtomicCheckpointIO` that writes in a background thread, one write in flight at a time.

    ``save_checkpoint`` waits for the previous write (it reads the staging buffers), copies the tensors into
    :class:`StagingBuffers` on the caller's thread (a point-in-time snapshot, the only stall), and returns;
    :attr:`last_write` is the handle of that write. ``remove_checkpoint`` is queued behind the write too:
    unlinking a large file costs about as long as the copy, and the training thread need not wait for it.
    A failed write is raised by the next ``save_checkpoint``, :meth:`raise_if_failed` (which
    :class:`PreemptionCheckpoint` calls after every batch, so a full disk stops training at once rather than at
    the next save) or :meth:`teardown`.
    """

    def __init__(self, recycle: bool = True, fsync: bool = True) -> None:
        super().__init__(recycle, fsync)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._staging = StagingBuffers()
        self.last_write: AsyncWrite | None = None

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None
    ) -> AsyncWrite:
        if storage_options is not None:
            raise TypeError(f"AsyncAtomicCheckpointIO does not take storage_options, got {storage_options!r}")
        self.wait()
        handle = AsyncWrite(Path(path))
        staged, ready = self._staging.stage(checkpoint)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accel-ckpt")

        def write() -> None:
            if ready is not None:
                ready.synchronize()  # the device-to-host copies queued by stage()
            AtomicCheckpointIO.save_checkpoint(self, staged, path)
            handle.finished = time.monotonic()

        handle.future = self._executor.submit(write)
        self._pending.append(handle.future)
        self.last_write = handle
        return handle

    @override
    def remove_checkpoint(self, path: PathLike) -> None:
        if self._executor is None:  # no write thread (before the first save, after teardown): now
            super().remove_checkpoint(path)
            return
        self._pending.append(self._executor.submit(AtomicCheckpointIO.remove_checkpoint, self, path))

    def raise_if_failed(self) -> None:
        """Raise the error of a finished write, if it failed (non-blocking)."""
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for future in done:
            future.result()

    def wait(self) -> None:
        """Block until the queued writes and removals are done; raise the first error."""
        pending, self._pending = self._pending, []
        errors = [err for err in (f.exception() for f in pending) if err is not None]
        if errors:
            raise errors[0]

    @override
    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            self._staging.clear()  # the host copy of the whole state: not kept past the fit
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            super().teardown()


def install_atomic_io(strategy: Strategy, async_save: bool, fsync: bool = True) -> None:
    """Give ``strategy`` our atomic checkpoint IO (async with ``async_save``; ``fsync=False`` for a staging folder)
    in place of Lightning's default one; a user's own IO plugin is respected, with a warning that its writes are not
    made atomic."""
    if writes_folders(strategy) and async_save:
        log.warning(
            "%s writes sharded checkpoint folders itself, synchronously: async_save=True applies to single-file "
            "checkpoints only. Folders are sealed with a manifest once every rank has written",
            type(strategy).__name__,
        )
    io = strategy.checkpoint_io
    if type(io) is TorchCheckpointIO:  # the default: upgrade it
        strategy.checkpoint_io = AsyncAtomicCheckpointIO(fsync=fsync) if async_save else AtomicCheckpointIO(fsync=fsync)
    elif not isinstance(io, (AtomicCheckpointIO, AsyncCheckpointIO)):
        log.warning(
            "%s uses its own checkpoint IO (%s): writes are not made atomic by PreemptionCheckpoint",
            type(strategy).__name__,
            type(io).__name__,
        )
