"""Resume from a bucket on an empty machine: the newest complete checkpoint, downloaded and verified once per node.

A checkpoint counts when its manifest is in the store and every object it names is there with the recorded size.
The chosen one is downloaded into the node's cache (``storage.node_cache.download_dir``) under a file lock: the
first rank of a node downloads it and checks its checksums, the node's other ranks (and a restart on the same
node) find it verified there. Lightning then loads the local copy, so a sharded folder (FSDP2's torch DCP, DeepSpeed)
resumes at another world size exactly as a local one does.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_accel.checkpoint.bucket_listing import confirm_objects, list_bucket_manifests
from lightning_accel.checkpoint.durable import MANIFEST_SUFFIX, manifest_path
from lightning_accel.checkpoint.verify import verify
from lightning_accel.storage import (
    OutageLog,
    download,
    download_dir,
    fetch_once_per_node,
    filesystem,
    join,
    redact,
    retrying,
)
from lightning_accel.storage.shards import folder_entries

__all__ = ["fetch_from_bucket", "find_in_bucket"]

log = logging.getLogger(__name__)

LIST_TIMEOUT_S = 60.0  # how long a resume retries listing a bucket that does not answer


def _fetch(fs: Any, root: str, name: str, manifest: dict[str, Any], local: Path) -> None:
    if manifest.get("kind") == "folder":
        entries = folder_entries(manifest)  # a hostile one (a path leaving the folder...) must not write outside
        if entries is None:
            raise ValueError("the manifest's list of files is not one of ours (a path outside the folder?)")
        for rel, entry in entries.items():
            download(fs, join(root, name, rel), local / rel, entry["bytes"])
    else:
        download(fs, join(root, name), local, manifest.get("bytes"))
    download(fs, join(root, name + MANIFEST_SUFFIX), manifest_path(local))


def _usable(fs: Any, root: str, name: str, manifest: dict[str, Any], url: str) -> str | None:
    """Download the checkpoint (once per node) and verify it; ``None`` when usable, else why not."""
    local = download_dir(url) / name

    def verified(path: Path) -> str | None:
        verdict = verify(path)
        return None if verdict and verdict.checked_by != "zip" else verdict.reason or "no manifest"

    try:
        return fetch_once_per_node(local, manifest, lambda p: _fetch(fs, root, name, manifest, p), verified)
    except (OSError, ValueError) as err:
        return f"could not be downloaded ({type(err).__name__}: {err})"


def find_in_bucket(url: str, pattern: str = "*.ckpt") -> str | None:
    """The local copy of the newest complete checkpoint under ``url`` (downloaded once per node), or ``None``."""
    fs, root = filesystem(url)
    listing = retrying(  # a dropped connection or a short outage is retried, a store that stays away is an error
        lambda: list_bucket_manifests(fs, root, pattern),
        OutageLog(url),
        "listing checkpoints",
        deadline=time.monotonic() + LIST_TIMEOUT_S,
    )
    for _, name, manifest in sorted(listing, key=lambda c: c[0], reverse=True):
        where = f"{redact(url)}/{name}"
        problem = confirm_objects(fs, root, name, manifest) or _usable(fs, root, name, manifest, url)
        if problem is not None:
            rank_zero_warn(f"Skipping checkpoint {where}: {problem}")
            continue
        local = download_dir(url) / name
        log.info("resuming from %s (local copy %s)", where, local)
        return str(local)
    return None


def fetch_from_bucket(url: str) -> str:
    """The local copy of the checkpoint at ``url`` (an explicit ``ckpt_path``), downloaded once per node and verified;
    a clear error when it is missing, incomplete or corrupt."""
    parent, _, name = url.rstrip("/").rpartition("/")
    fs, root = filesystem(parent)
    try:
        manifest = {m_name: m for _, m_name, m in list_bucket_manifests(fs, root, name)}.get(name)
    except OSError as err:
        raise FileNotFoundError(f"Cannot read {redact(url)}: {type(err).__name__}: {err}") from None
    if manifest is None:
        raise FileNotFoundError(
            f"Checkpoint {redact(url)} has no readable manifest in the store: it was not completely uploaded (or not "
            f"by lightning-accel). Resume with lightning_accel.find_resume_checkpoint({redact(parent)!r}) to pick the "
            "newest complete one"
        )
    problem = confirm_objects(fs, root, name, manifest) or _usable(fs, root, name, manifest, parent)
    if problem is not None:
        raise FileNotFoundError(f"Checkpoint {redact(url)} is not usable: {problem}")
    return str(download_dir(parent) / name)
