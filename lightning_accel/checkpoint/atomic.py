"""Atomic checkpoint files with a checksum manifest.

A checkpoint is written to a hidden temporary file in the same folder, fsynced, and renamed into place
(``os.replace`` is atomic on POSIX); a ``<name>.manifest.json`` beside it records its size and SHA-256.
A crash at any point leaves either the complete new checkpoint or nothing new, never a torn file under
the real name, and a checkpoint is only trusted when its manifest matches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import zipfile
from pathlib import Path
from typing import IO, Any, Callable

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

log = logging.getLogger(__name__)

MANIFEST_SUFFIX = ".manifest.json"
TMP_MARKER = ".tmp-"


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is truncated, altered or unreadable."""


def manifest_path(path: _PATH) -> Path:
    return Path(str(path) + MANIFEST_SUFFIX)


class _HashingWriter:
    """File-like wrapper that hashes bytes as ``torch.save`` writes them (no second read pass)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

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


def atomic_save(obj: Any, path: _PATH, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``torch.save(obj, path)`` atomically and durably; returns the manifest written beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    digest: dict[str, Any] = {}

    def write_checkpoint(f: IO[bytes]) -> None:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        digest.update(sha256=writer.sha.hexdigest(), bytes=writer.size)

    _write_durably(path, write_checkpoint)
    manifest = {"format": 1, "file": path.name, **digest, "created_unix": time.time(), **(meta or {})}
    # The manifest goes last: a checkpoint without a matching manifest is never trusted.
    _write_durably(manifest_path(path), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    _fsync_dir(path.parent)
    return manifest


def read_manifest(path: _PATH) -> dict[str, Any] | None:
    try:
        return json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        return None


def verify(path: _PATH, checksum: bool = True) -> str | None:
    """Return ``None`` if ``path`` is a complete checkpoint, else why it is not.

    With a manifest, size and SHA-256 must match (``checksum=False`` checks the size only: cheap
    enough for the training thread). Without one (a file another tool wrote), the zip container
    torch uses must be readable end to end, which catches truncation.
    """
    path = Path(path)
    if not path.is_file():
        return "missing"
    manifest = read_manifest(path)
    if manifest is None:
        if manifest_path(path).exists():
            return "unreadable manifest"
        try:
            with zipfile.ZipFile(path) as zf:
                bad = zf.testzip()
            return f"corrupt member {bad}" if bad else None
        except (zipfile.BadZipFile, OSError) as err:
            return f"not a readable torch checkpoint ({err})"
    size = path.stat().st_size
    if size != manifest.get("bytes"):
        return f"size {size} != {manifest.get('bytes')} recorded in the manifest (truncated?)"
    if not checksum:
        return None
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    if sha.hexdigest() != manifest.get("sha256"):
        return "SHA-256 does not match the manifest (file altered or torn)"
    return None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` that writes atomically with a manifest and verifies before loading.

    Use directly (``Trainer(plugins=[AtomicCheckpointIO()])``) or wrap it in Lightning's
    ``AsyncCheckpointIO`` for background writes; :class:`PreemptionCheckpoint` installs it for you.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO does not take storage_options, got {storage_options!r}")
        meta = {k: checkpoint[k] for k in ("epoch", "global_step") if k in checkpoint}
        atomic_save(checkpoint, path, meta)

    def load_checkpoint(self, path: _PATH, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None) -> dict[str, Any]:
        if Path(path).is_file() and (problem := verify(path)) is not None:
            raise CorruptCheckpointError(
                f"Checkpoint {path} is not usable: {problem}. Resume from an earlier checkpoint "
                "(lightning_accel.find_resume_checkpoint picks the newest valid one)."
            )
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: _PATH) -> None:
        super().remove_checkpoint(path)
        manifest_path(path).unlink(missing_ok=True)
