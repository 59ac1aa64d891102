"""Which rank wrote each file of a sharded checkpoint folder, and each rank's share of checking them.

A folder of shards (torch DCP under FSDP2, DeepSpeed ZeRO) is written by every rank, each its own files. So that no
rank reads the whole model back, each rank checksums the shards it wrote when the folder is saved (from its page
cache, all ranks at once) and rank 0 puts those digests in the folder's manifest; on resume, before the strategy
reads a byte, each rank checks its share of them (the shards its rank wrote, when the world size is the same;
dealt round-robin otherwise) and the ranks agree on one verdict. The time does not grow with the number of ranks.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import xxhash

from lightning_accel.storage.trust import parse_json_object

__all__ = [
    "CHECKSUM",
    "MANIFEST_SUFFIX",
    "CorruptShardError",
    "check_share",
    "file_digest",
    "folder_entries",
    "shard_digests",
    "share",
    "verify_shards",
    "writer_rank",
]

CHECKSUM = "xxh3_64"
MANIFEST_SUFFIX = ".manifest.json"  # a checkpoint's manifest sits beside it: "<checkpoint>.manifest.json"
# The writer's global rank in a shard's name: torch DCP's FileSystemWriter (``__<rank>_<n>.distcp``) and DeepSpeed's
# ZeRO partitions (``[bf16_]zero_pp_rank_<rank>_mp_rank_<mp>_{optim,model}_states.pt``).
_SHARD_NAMES = (re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$"), re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_"))


class CorruptShardError(RuntimeError):
    """A shard of a sealed checkpoint folder does not match its manifest (every rank raises it, before loading)."""


def file_digest(path: Path, kind: str = CHECKSUM) -> str:
    """Hex digest of a file's bytes, read in 4 MB chunks: ``"xxh3_64"`` (ours) or ``"sha256"`` (format-1 manifests)."""
    hasher = xxhash.xxh3_64() if kind == CHECKSUM else hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def folder_entries(manifest: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """A folder manifest's ``files`` (relative path -> {"bytes", checksum}), or ``None`` when anything in it is not
    what a manifest of ours holds (a list, a negative size, a path leaving the folder): not trusted, never a crash."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        return None
    for rel, entry in files.items():
        parts = Path(rel).parts if isinstance(rel, str) else ("..",)
        if ".." in parts or Path(rel).is_absolute() or not isinstance(entry, dict):
            return None
        size, digest = entry.get("bytes"), entry.get(CHECKSUM, "")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str):
            return None
    return files


def writer_rank(rel: str) -> int | None:
    """The global rank that wrote the shard at ``rel`` (a path inside the folder), or ``None`` (metadata: rank 0's)."""
    for pattern in _SHARD_NAMES:
        if (found := pattern.search(rel)) is not None:
            return int(found.group(1))
    return None


def share(files: Iterable[str], rank: int, world_size: int) -> list[str]:
    """The shards ``rank`` of ``world_size`` checks: those whose writer rank is ``rank`` modulo the world size."""
    return sorted(rel for rel in files if (w := writer_rank(rel)) is not None and w % world_size == rank)


def shard_digests(folder: Path, rank: int) -> dict[str, str]:
    """Digests of the shards ``rank`` wrote into ``folder`` (relative path -> xxh3-64)."""
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    return {rel: file_digest(folder / rel) for rel in files if writer_rank(rel) == rank}


def check_share(folder: Path, manifest: dict[str, Any], rank: int, world_size: int) -> str | None:
    """``None`` when every shard of ``rank``'s share matches its size and checksum in ``manifest``; else which not."""
    entries = folder_entries(manifest)
    if entries is None:
        return "its manifest's list of files is not one of ours (not trusted)"
    for rel in share(entries, rank, world_size):
        entry, path = entries[rel], folder / rel
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            return f"{rel} is missing or not {entry['bytes']} bytes"
        if CHECKSUM in entry and file_digest(path) != entry[CHECKSUM]:
            return f"{rel}: its xxh3-64 checksum does not match the manifest (altered or torn)"
    return None


def _gather(value: str | None) -> list[str | None]:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    values: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def verify_shards(folder: Path, rank: int, world_size: int) -> None:
    """Every rank checks its share of ``folder``'s shards against the manifest beside it, then all agree: raise
    :class:`CorruptShardError` on every rank when any share fails (a collective: every rank must call it). A folder
    without a readable manifest is left to the search that picked it (``find_resume_checkpoint``)."""
    try:
        manifest = parse_json_object(Path(str(folder) + MANIFEST_SUFFIX).read_bytes())
    except OSError:
        manifest = None
    reason = check_share(folder, manifest, rank, world_size) if manifest is not None else None
    found = [f"rank {r}: {why}" for r, why in enumerate(_gather(reason)) if why]
    if found:
        raise CorruptShardError(
            f"Checkpoint {folder} cannot be loaded: " + "; ".join(found) + ". Resume from the checkpoint before it "
            "(ckpt_path=..., or move this folder aside: find_resume_checkpoint then picks the previous one)"
        )
