"""Atomic checkpoint files with a checksum manifest.

A checkpoint is written to a hidden temporary file in the same folder, fsynced, and renamed into place
(``os.replace`` is atomic on POSIX); a ``<name>.manifest.json`` beside it records its size and SHA-256.
A crash at any point leaves either the complete new checkpoint or nothing new, never a torn file under
the real name, and a checkpoint is only trusted when its manifest matches.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

MANIFEST_SUFFIX = ".manifest.json"
TMP_MARKER = ".tmp-"
# Top-level checkpoint key PreemptionCheckpoint adds; copied into the manifest so pruning can tell runs apart.
RUN_ID_KEY = "lightning_accel_run_id"


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is truncated, altered or unreadable."""


# A file path as Lightning's CheckpointIO methods take it.
PathLike = str | os.PathLike[str]


def manifest_path(path: PathLike) -> Path:
    return Path(str(path) + MANIFEST_SUFFIX)


class _HashingWriter:
    """File-like wrapper that hashes bytes as ``torch.save`` writes them (no second read pass).

    It keeps the ``OSError`` of a failed write: torch's zip writer replaces it with an opaque
    ``RuntimeError`` ("unexpected pos"), and a full disk must be reported as a full disk.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    tmp = path.with_name(f".{path.name}{TMP_MARKER}{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _explain_write_error(err: OSError, path: Path) -> OSError:
    """The write's own ``OSError``, with the checkpoint's path and the free space named."""
    try:
        free = f"{shutil.disk_usage(path.parent).free / 1e6:.1f} MB free"
    except OSError:
        free = "free space unknown"
    return OSError(err.errno, f"Writing checkpoint {path} failed: {err.strerror} ({free} on that file system)")


def atomic_save(obj: Any, path: PathLike, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``torch.save(obj, path)`` atomically and durably; returns the manifest written beside it."""
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
        digest.update(sha256=writer.sha.hexdigest(), bytes=writer.size)

    _write_durably(path, write_checkpoint)
    manifest = {"format": 1, "file": path.name, **digest, "created_unix": time.time(), **(meta or {})}
    # The manifest goes last: a checkpoint without a matching manifest is never trusted.
    _write_durably(manifest_path(path), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    _fsync_dir(path.parent)
    return manifest


def read_manifest(path: PathLike) -> dict[str, Any] | None:
    """The manifest beside ``path``, or ``None`` when it is missing or unreadable."""
    try:
        manifest = json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


@dataclass(frozen=True)
class Verdict:
    """Whether a checkpoint file is complete, and how that was decided.

    ``bool(verdict)`` is ``ok``. ``checked_by`` is ``"sha256"`` or ``"size"`` (against the manifest) or
    ``"zip"`` (no usable manifest: torch's zip container and its CRCs were read end to end).
    """

    ok: bool
    reason: str = ""
    checked_by: str = "sha256"

    def __bool__(self) -> bool:
        return self.ok


def _verify_zip(path: Path, why: str) -> Verdict:
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError) as err:
        return Verdict(False, f"{why}; not a readable torch checkpoint ({err})", "zip")
    if bad:
        return Verdict(False, f"{why}; corrupt member {bad}", "zip")
    return Verdict(True, f"{why}; the zip container and its CRCs are intact", "zip")


def verify(path: PathLike, checksum: bool = True) -> Verdict:
    """Check that ``path`` is a complete checkpoint.

    With a manifest, size and SHA-256 must match (``checksum=False`` checks the size only). Without a
    usable manifest (missing, unreadable, or a file another tool wrote), the zip container torch uses
    must be readable end to end with matching CRCs, which catches truncation and most corruption.
    """
    path = Path(path)
    if not path.is_file():
        return Verdict(False, "missing", "size")
    manifest = read_manifest(path)
    if manifest is None:
        why = "unreadable manifest" if manifest_path(path).exists() else "no manifest"
        return _verify_zip(path, why)
    size = path.stat().st_size
    if size != manifest.get("bytes"):
        return Verdict(False, f"size {size} != {manifest.get('bytes')} recorded in the manifest (truncated?)", "size")
    if not checksum:
        return Verdict(True, checked_by="size")
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    if sha.hexdigest() != manifest.get("sha256"):
        return Verdict(False, "SHA-256 does not match the manifest (file altered or torn)")
    return Verdict(True)


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

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO does not take storage_options, got {storage_options!r}")
        atomic_save(checkpoint, path, _manifest_meta(checkpoint))

    def load_checkpoint(
        self, path: PathLike, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if Path(path).is_file() and not (verdict := verify(path)):
            raise CorruptCheckpointError(
                f"Checkpoint {path} is not usable: {verdict.reason}. Resume from an earlier checkpoint "
                "(lightning_accel.find_resume_checkpoint picks the newest valid one)."
            )
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: PathLike) -> None:
        super().remove_checkpoint(path)
        manifest_path(path).unlink(missing_ok=True)


class AsyncAtomicCheckpointIO(AtomicCheckpointIO):
    """:class:`AtomicCheckpointIO` that writes in a background thread, one write in flight at a time.

    ``save_checkpoint`` copies the tensors on the caller's thread (a point-in-time snapshot), waits for
    the previous write, and returns. A failed write is raised by the next ``save_checkpoint``,
    :meth:`raise_if_failed` (which :class:`PreemptionCheckpoint` calls after every batch, so a full disk
    stops training at once rather than at the next save) or :meth:`teardown`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        snapshot = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())
        self.wait()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accel-ckpt")
        self._pending = self._executor.submit(super().save_checkpoint, snapshot, path, storage_options)

    def raise_if_failed(self) -> None:
        """Raise the error of a finished write, if it failed (non-blocking)."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def wait(self) -> None:
        """Block until the write in flight is done; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
