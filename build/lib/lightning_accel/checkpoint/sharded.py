"""Sharded checkpoint folders (torch DCP under FSDP2 / ``ModelParallelStrategy``, DeepSpeed's own writer): sealed
with the same manifest a single file gets, so resume discovery, pruning and verification cover them too.

The strategy writes the folder (every rank its shards; torch DCP writes its ``.metadata`` last, Lightning's
``meta.pt`` follows on rank 0). Once all ranks are done, rank 0 writes ``<folder>.manifest.json`` listing every
file with its size, and an xxh3-64 checksum of the files up to :data:`CHECKSUM_LIMIT` (the metadata: loops,
callbacks, RNG states, DCP's index of the shards). The shards are checked by size: checksumming them would
read the whole model back on one rank. A folder without a manifest was not finished (or not written by
us): it is trusted only when it holds DCP's ``.metadata``, with a warning.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning_accel.checkpoint.durable import CHECKSUM, MANIFEST_FORMAT, Verdict, file_digest, write_manifest

CHECKSUM_LIMIT = 64 * 2**20  # files up to this size are checksummed: metadata, not shards
DCP_METADATA = ".metadata"


def folder_files(folder: Path) -> list[Path]:
    """Every file under ``folder``, sorted: what a sealed folder's manifest lists, and what goes to a bucket."""
    return sorted(p for p in folder.rglob("*") if p.is_file())


def seal_folder(folder: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the manifest of a finished checkpoint folder (on one rank, after every rank has written)."""
    files: dict[str, dict[str, Any]] = {}
    for path in folder_files(folder):
        entry: dict[str, Any] = {"bytes": path.stat().st_size}
        if entry["bytes"] <= CHECKSUM_LIMIT:
            entry[CHECKSUM] = file_digest(path)
        files[path.relative_to(folder).as_posix()] = entry
    manifest = {
        "format": MANIFEST_FORMAT,
        "kind": "folder",
        "file": folder.name,
        "files": files,
        "bytes": sum(e["bytes"] for e in files.values()),
        "created_unix": time.time(),
        **(meta or {}),
    }
    write_manifest(folder, manifest)
    return manifest


def verify_folder(folder: Path, manifest: dict[str, Any] | None, checksum: bool = True) -> Verdict:
    """Every file the manifest lists is there with its size (and checksum, for the small ones)."""
    if manifest is None or manifest.get("kind") != "folder":
        if (folder / DCP_METADATA).is_file():
            return Verdict(True, "no manifest; torch DCP's .metadata is there (its shards are unchecked)", "dcp")
        return Verdict(False, "a folder with neither a manifest nor torch DCP's .metadata (unfinished?)", "size")
    for name, entry in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return Verdict(False, f"{name} is missing from the folder", "size")
        if path.stat().st_size != entry.get("bytes"):
            return Verdict(False, f"{name}: size {path.stat().st_size} != {entry.get('bytes')} (truncated?)", "size")
        if checksum and CHECKSUM in entry and file_digest(path) != entry[CHECKSUM]:
            return Verdict(False, f"{name}: xxh3-64 checksum does not match the manifest (altered or torn)", CHECKSUM)
    return Verdict(True, checked_by=CHECKSUM if checksum else "size")
