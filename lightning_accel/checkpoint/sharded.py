"""Sharded checkpoint folders (torch DCP under FSDP2 / ``ModelParallelStrategy``, DeepSpeed's own writer): sealed
with the same manifest a single file gets, so resume discovery, pruning and verification cover them too.

The strategy writes the folder (every rank its shards; torch DCP writes its ``.metadata`` last, Lightning's
``meta.pt`` follows on rank 0). Once all ranks are done, each checksums the shards it wrote and rank 0 writes
``<folder>.manifest.json`` listing every file with its size and xxh3-64 checksum (the other files up to
:data:`CHECKSUM_LIMIT`: the metadata, loops, callbacks, RNG states, DCP's index). A search checks sizes and the
metadata's checksums; each rank checks its share of the shards before the strategy loads them (``storage.shards``),
so no rank reads the whole model back. A folder without a manifest was not finished (or not written by
us): it is trusted only when it holds DCP's ``.metadata``, with a warning.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy

from lightning_accel._compat import saves_distributed_checkpoint
from lightning_accel.checkpoint.durable import (
    CHECKSUM,
    MANIFEST_FORMAT,
    TMP_MARKER,
    Verdict,
    file_digest,
    write_manifest,
)
from lightning_accel.storage.shards import folder_entries

__all__ = ["folder_files", "ranks_share_folder", "seal_folder", "verify_folder", "writes_folders"]

CHECKSUM_LIMIT = 64 * 2**20  # files up to this size are checksummed: metadata, not shards
DCP_METADATA = ".metadata"


def writes_folders(strategy: Strategy) -> bool:
    """Whether ``strategy`` saves a folder of shards, every rank its own, instead of one file from rank 0."""
    return isinstance(strategy, DeepSpeedStrategy) or saves_distributed_checkpoint(strategy)


def ranks_share_folder(strategy: Strategy, is_global_zero: bool, folder: Path) -> bool:
    """Whether every rank sees the files rank 0 writes in ``folder`` (one machine, or a file system the machines
    share): rank 0 writes a marker, every rank looks for it. Every rank must call this (two collectives).

    A folder of shards is sealed and uploaded by rank 0 alone, so it must see every rank's shards; a rank on another
    machine writing into its own local disk would leave them out of the checkpoint.
    """
    token = strategy.broadcast(uuid.uuid4().hex if is_global_zero else None, src=0)
    marker = folder / f".lightning_accel-shared{TMP_MARKER}{token}"
    if is_global_zero:
        marker.write_text(token)
    strategy.barrier("lightning_accel-shared-folder")
    try:
        seen = marker.is_file() and marker.read_text() == token
    except OSError:
        seen = False
    every_rank = strategy.reduce_boolean_decision(seen, all=True)
    if is_global_zero:  # every rank has looked: the reduction above is a collective
        marker.unlink(missing_ok=True)
    return bool(every_rank)


def folder_files(folder: Path) -> list[Path]:
    """Every file under ``folder``, sorted: what a sealed folder's manifest lists, and what goes to a bucket."""
    return sorted(p for p in folder.rglob("*") if p.is_file())


def seal_folder(
    folder: Path, meta: dict[str, Any] | None = None, shard_digests: dict[str, str] | None = None
) -> dict[str, Any]:
    """Write the manifest of a finished checkpoint folder (on one rank, after every rank has written):
    ``shard_digests`` are the shards' checksums their writers computed (``storage.shards``); the other files are
    checksummed here up to :data:`CHECKSUM_LIMIT`."""
    files: dict[str, dict[str, Any]] = {}
    digests = shard_digests or {}
    for path in folder_files(folder):
        rel = path.relative_to(folder).as_posix()
        entry: dict[str, Any] = {"bytes": path.stat().st_size}
        if rel in digests:
            entry[CHECKSUM] = digests[rel]
        elif entry["bytes"] <= CHECKSUM_LIMIT:
            entry[CHECKSUM] = file_digest(path)
        files[rel] = entry
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
    entries = folder_entries(manifest)
    if entries is None:
        return Verdict(
            False, "its manifest's list of files is not one of ours (hostile or damaged: not trusted)", "size"
        )
    for name, entry in entries.items():
        path = folder / name
        if not path.is_file():
            return Verdict(False, f"{name} is missing from the folder", "size")
        if path.stat().st_size != entry["bytes"]:
            return Verdict(False, f"{name}: size {path.stat().st_size} != {entry['bytes']} (truncated?)", "size")
        # files up to CHECKSUM_LIMIT here (the metadata); larger shards by the ranks that load them (storage.shards)
        small = entry["bytes"] <= CHECKSUM_LIMIT
        if checksum and small and CHECKSUM in entry and file_digest(path) != entry[CHECKSUM]:
            return Verdict(False, f"{name}: xxh3-64 checksum does not match the manifest (altered or torn)", CHECKSUM)
    return Verdict(True, checked_by=CHECKSUM if checksum else "size")
