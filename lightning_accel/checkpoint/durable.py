"""What both checkpoint kinds (single files and sharded folders) share: durable writes, manifests, digests, verdicts.

A checkpoint is trusted only when the ``<name>.manifest.json`` beside it matches it. Manifests are written with
:func:`write_durably` (temporary file, fsync, rename), so a crash never leaves a torn one under the real name.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from lightning_accel.storage import parse_json_object
from lightning_accel.storage.shards import (  # (re-exported: the checkpoint room's names)
    CHECKSUM,
    MANIFEST_SUFFIX,
    file_digest,
)

__all__ = [
    "CHECKSUM",
    "MANIFEST_FORMAT",
    "MANIFEST_SUFFIX",
    "RUN_ID_KEY",
    "TMP_MARKER",
    "PathLike",
    "Verdict",
    "file_digest",
    "fsync_dir",
    "manifest_path",
    "parse_manifest",
    "read_manifest",
    "write_durably",
    "write_manifest",
]

MANIFEST_FORMAT = 2  # 2: xxh3_64 checksum; 1: sha256
TMP_MARKER = ".tmp-"
# Top-level checkpoint key PreemptionCheckpoint adds; copied into the manifest so pruning can tell runs apart.
RUN_ID_KEY = "lightning_accel_run_id"

# A file path as Lightning's CheckpointIO methods take it.
PathLike = str | os.PathLike[str]


def manifest_path(path: PathLike) -> Path:
    return Path(str(path) + MANIFEST_SUFFIX)


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (the directory entry, not only the file's bytes)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(
    path: Path, write: Callable[[IO[bytes]], None], reuse: Path | None = None, fsync: bool = True
) -> None:
    """Write to a hidden temporary file (``reuse``, a spare file, overwritten in place, when given), fsync it and
    rename it to ``path``: readers see the old file or the complete new one, never a torn one. ``fsync=False``
    keeps the rename (never a torn file under the real name) but not the durability: for a copy staged on its way
    to an object store, which holds the durable one."""
    tmp = (
        reuse if reuse is not None else path.with_name(f".{path.name}{TMP_MARKER}{os.getpid()}-{threading.get_ident()}")
    )
    try:
        with open(tmp, "r+b" if reuse is not None else "wb") as f:
            write(f)
            f.truncate()  # a spare longer than the new checkpoint
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_manifest(path: PathLike, manifest: dict[str, Any], fsync: bool = True) -> None:
    """Write the manifest of ``path`` durably (the checkpoint itself must be durable already)."""
    path = Path(path)
    write_durably(manifest_path(path), lambda f: f.write(json.dumps(manifest, indent=1).encode()), fsync=fsync)
    if fsync:
        fsync_dir(path.parent)


def parse_manifest(data: bytes) -> dict[str, Any] | None:
    """A manifest's bytes as a JSON object, or ``None`` (not trusted: ``storage.trust``'s one policy)."""
    return parse_json_object(data)


def read_manifest(path: PathLike) -> dict[str, Any] | None:
    """The manifest beside ``path``, or ``None`` when it is missing or unreadable."""
    try:
        data = manifest_path(path).read_bytes()
    except OSError:
        return None
    return parse_manifest(data)


@dataclass(frozen=True)
class Verdict:
    """Whether a checkpoint is complete, and how that was decided.

    ``bool(verdict)`` is ``ok``. ``checked_by`` is ``"xxh3_64"`` (format-1 manifests: ``"sha256"``) or
    ``"size"`` (against the manifest) or ``"zip"`` (no usable manifest: torch's zip container and its CRCs
    were read end to end) or ``"dcp"`` (a folder without a manifest holding torch DCP's metadata).
    """

    ok: bool
    reason: str = ""
    checked_by: str = CHECKSUM

    def __bool__(self) -> bool:
        return self.ok
