"""Atomic checkpoint files with a checksum manifest.

A checkpoint is written to a hidden temporary file in the same folder, fsynced, and renamed into place
(``os.replace`` is atomic on POSIX); a ``<name>.manifest.json`` beside it records its size and an xxh3-64
checksum of its bytes, hashed while they are written (xxh3 runs at tens of GB/s on one core, an order of magnitude
faster than SHA-256, and the training host's cores are busy training). A crash at any point
leaves either the complete new checkpoint or nothing new, never a torn file under the real name, and a
checkpoint is only trusted when its manifest matches. Manifests of format 1 (SHA-256) are still verified.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
import xxhash
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_accel.checkpoint.bucket_resume import fetch_from_bucket
from lightning_accel.checkpoint.durable import (
    CHECKSUM,
    MANIFEST_FORMAT,
    RUN_ID_KEY,
    TMP_MARKER,
    PathLike,
    manifest_path,
    write_durably,
    write_manifest,
)
from lightning_accel.checkpoint.verify import verified_once_per_node
from lightning_accel.storage import check_storage_url, is_remote

__all__ = ["AtomicCheckpointIO", "CorruptCheckpointError", "atomic_save"]


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is truncated, altered or unreadable."""


class _HashingWriter:
    """File-like wrapper that checksums bytes as ``torch.save`` writes them (no second read pass).

    It keeps the ``OSError`` of a failed write: torch's zip writer replaces it with an opaque
    ``RuntimeError`` ("unexpected pos"), and a full disk must be reported as a full disk.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.hash, self.size = f, xxhash.xxh3_64(), 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def _explain_write_error(err: OSError, path: Path) -> OSError:
    """The write's own ``OSError``, with the checkpoint's path and the free space named."""
    try:
        free = f"{shutil.disk_usage(path.parent).free / 1e6:.1f} MB free"
    except OSError:
        free = "free space unknown"
    return OSError(err.errno, f"Writing checkpoint {path} failed: {err.strerror} ({free} on that file system)")


def atomic_save(
    obj: Any,
    path: PathLike,
    meta: dict[str, Any] | None = None,
    reuse: Path | None = None,
    before_manifest: Callable[[Path], None] | None = None,
    fsync: bool = True,
) -> dict[str, Any]:
    """``torch.save(obj, path)`` atomically and durably; returns the manifest written beside it.

    ``reuse``: a spare file in the same folder (an old checkpoint renamed to a hidden temporary name) to
    overwrite in place instead of allocating a new file; it is renamed to ``path`` or removed on failure.
    ``before_manifest``: called with ``path`` once the file is durable, before the manifest makes it count.
    ``fsync=False``: renamed into place but not fsynced (a copy staged for an object store, which keeps the durable
    one).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    digest: dict[str, Any] = {}

    def write_checkpoint(f: IO[bytes]) -> None:
        writer = _HashingWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError as err:
            if writer.error is None:
                raise
            raise _explain_write_error(writer.error, path) from err
        digest.update({CHECKSUM: writer.hash.hexdigest(), "bytes": writer.size})

    write_durably(path, write_checkpoint, reuse, fsync)
    if before_manifest is not None:
        before_manifest(path)
    manifest = {"format": MANIFEST_FORMAT, "file": path.name, **digest, "created_unix": time.time(), **(meta or {})}
    # The manifest goes last: a checkpoint without a matching manifest is never trusted.
    write_manifest(path, manifest, fsync)
    return manifest


def _manifest_meta(checkpoint: dict[str, Any]) -> dict[str, Any]:
    meta = {k: checkpoint[k] for k in ("epoch", "global_step") if k in checkpoint}
    if RUN_ID_KEY in checkpoint:
        meta["run_id"] = checkpoint[RUN_ID_KEY]
    return meta


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` that writes atomically with a manifest and verifies before loading.

    Use directly (``Trainer(plugins=[AtomicCheckpointIO()])``) or as :class:`AsyncAtomicCheckpointIO`
    for background writes; :class:`PreemptionCheckpoint` installs one for you.
    """

    def __init__(self, recycle: bool = True, fsync: bool = True) -> None:
        super().__init__()
        self.recycle, self.fsync = recycle, fsync
        self._written: dict[str, tuple[int, int]] = {}  # path -> (size, mtime_ns) of what this IO wrote
        self._spares: dict[Path, Path] = {}  # folder -> a removed checkpoint kept to be overwritten
        self._saving = False  # between the first save and teardown: a spare is only kept for a save to come

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO does not take storage_options, got {storage_options!r}")
        path, self._saving = Path(path), True
        spare = self._spares.pop(path.parent, None)
        reuse = spare if spare and spare.is_file() else None
        # recorded before the manifest is written: once it is, pruning on another thread may look at this file
        atomic_save(
            checkpoint, path, _manifest_meta(checkpoint), reuse, before_manifest=self._record_written, fsync=self.fsync
        )

    def _record_written(self, path: Path) -> None:
        stat = path.stat()
        self._written[str(path)] = (stat.st_size, stat.st_mtime_ns)

    def wrote(self, path: PathLike) -> bool:
        """Whether this IO wrote ``path`` as it is now (same size and modification time).

        Its checksum was computed from the very bytes written and the file was fsynced, so keeping it needs
        no second read; a file changed since (even to the same size) has another modification time.
        """
        try:
            stat = Path(path).stat()
        except OSError:
            return False
        return self._written.get(str(path)) == (stat.st_size, stat.st_mtime_ns)

    @override
    def load_checkpoint(
        self, path: PathLike, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if is_remote(path):  # a bucket URL: its local copy, downloaded once per node and verified against the store
            check_storage_url(path, "ckpt_path")
            path = fetch_from_bucket(str(path))
        if Path(path).is_file() and not (verdict := verified_once_per_node(Path(path))):  # one read per node
            raise CorruptCheckpointError(
                f"Checkpoint {path} is not usable: {verdict.reason}. Resume from an earlier checkpoint "
                "(lightning_accel.find_resume_checkpoint picks the newest valid one)."
            )
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: PathLike) -> None:
        """Remove ``path`` and its manifest. With ``recycle``, one removed file per folder is kept under a hidden
        temporary name for the next save to overwrite: overwriting pages already allocated costs less than
        allocating a new file and freeing the old one (benchmarks/checkpoint_async.py measures the difference)."""
        path = Path(path)
        self._written.pop(str(path), None)
        if self.recycle and self._saving and path.is_file() and path.parent not in self._spares:
            spare = path.with_name(f".spare{TMP_MARKER}{os.getpid()}-{id(self)}")
            os.replace(path, spare)  # first, so the manifest never vouches for a file being overwritten
            self._spares[path.parent] = spare
        else:
            super().remove_checkpoint(path)
        manifest_path(path).unlink(missing_ok=True)

    @override
    def teardown(self) -> None:
        """Delete the spare files kept for recycling."""
        spares, self._spares, self._saving = self._spares, {}, False
        for spare in spares.values():
            spare.unlink(missing_ok=True)
