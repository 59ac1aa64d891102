"""Local folders for remote runs: where checkpoints are staged before upload, and where downloads are cached.

Both live under ``LIGHTNING_ACCEL_CACHE_DIR`` (default ``~/.cache/lightning_accel``), one folder per URL. The
cache is shared by the processes of one node: the first rank to ask for an object downloads and verifies it under
an exclusive file lock, the others wait on the lock and find it there (one download and one verification per node,
whatever the number of ranks on it).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning_accel.storage.urls import url_hash

__all__ = ["CACHE_ENV", "cache_root", "download_dir", "fetch_once_per_node", "node_lock", "staging_dir"]

CACHE_ENV = "LIGHTNING_ACCEL_CACHE_DIR"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lightning_accel")


def staging_dir(url: str) -> Path:
    """The local folder a remote ``dirpath``'s checkpoints are written to before they are uploaded."""
    return cache_root() / "staging" / url_hash(url)


def download_dir(url: str) -> Path:
    """The local folder objects of ``url`` are downloaded into (shared by the ranks of a node)."""
    return cache_root() / "downloads" / url_hash(url)


@contextmanager
def node_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` shared by the processes of this node (``flock``): one at a time inside."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_once_per_node(
    local: Path, fingerprint: dict[str, Any], fetch: Callable[[Path], None], verify: Callable[[Path], str | None]
) -> str | None:
    """Make ``local`` hold the object ``fingerprint`` describes (its manifest), fetched and verified once per node.

    ``fetch(local)`` downloads it; ``verify(local)`` returns ``None`` when it is intact, else the reason. A marker
    beside ``local`` records the fingerprint once verified, so the ranks after the first (and a restart on the
    same node) neither download nor verify again. Returns ``None`` when usable, else the reason it is not.
    """
    marker = local.with_name(f".{local.name}.verified")
    wanted = json.dumps(fingerprint, sort_keys=True, default=str)
    with node_lock(local.with_name(f".{local.name}.lock")):
        if marker.is_file() and marker.read_text() == wanted and local.exists():
            return None
        marker.unlink(missing_ok=True)
        fetch(local)
        reason = verify(local)
        if reason is None:
            marker.write_text(wanted)
        return reason
