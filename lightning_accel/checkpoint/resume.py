"""Find the newest checkpoint that is complete, skipping truncated or corrupt ones."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_warn

from lightning_accel.checkpoint.bucket_resume import find_in_bucket
from lightning_accel.checkpoint.durable import TMP_MARKER, PathLike, read_manifest
from lightning_accel.checkpoint.verify import verified_once_per_node
from lightning_accel.storage import check_storage_url, is_remote

__all__ = ["find_resume_checkpoint", "list_checkpoints", "recorded_step"]

log = logging.getLogger(__name__)

_STEP_IN_NAME = re.compile(r"step=(\d+)")


def recorded_step(path: Path) -> int | None:
    """The global step of a checkpoint: from its manifest, else from a ``step=N`` in its name."""
    step = (read_manifest(path) or {}).get("global_step")
    if isinstance(step, int):
        return step
    match = _STEP_IN_NAME.search(path.name)
    return int(match.group(1)) if match else None


def _order_key(path: Path) -> tuple[int, float]:
    step = recorded_step(path)
    return (step if step is not None else -1, path.stat().st_mtime)


def list_checkpoints(dirpath: PathLike, pattern: str = "*.ckpt") -> list[Path]:
    """Checkpoints in ``dirpath`` (files and sharded folders), newest first (by global step, then modification time).

    The step comes from the manifest, or from a ``step=N`` in the file name when the manifest is
    missing or unreadable, so such a file is not mistaken for the oldest.
    """
    folder = Path(dirpath)
    if not folder.is_dir():
        return []
    # files, and the folders sharded strategies write (torch DCP, DeepSpeed)
    files = [p for p in folder.glob(pattern) if (p.is_file() or p.is_dir()) and TMP_MARKER not in p.name]
    return sorted(files, key=_order_key, reverse=True)


def find_resume_checkpoint(dirpath: PathLike, pattern: str = "*.ckpt") -> str | None:
    """Path of the newest valid checkpoint in ``dirpath``, or ``None`` to start fresh.

    Use as ``trainer.fit(model, ckpt_path=find_resume_checkpoint("checkpoints"))``. Invalid files are
    skipped with a warning naming the reason, never deleted; a file whose manifest is missing or
    unreadable is used when its zip container is intact, with a warning saying so.

    ``dirpath`` may be a bucket URL (``s3://bucket/run1``, ``gs://``, ``az://``): the newest checkpoint whose manifest
    and objects are complete in the store is downloaded once per node into the local cache and verified there, and
    the local copy's path is returned (docs/checkpointing.md, "Checkpoints in a bucket").
    """
    if is_remote(str(dirpath)):
        check_storage_url(str(dirpath))
        return find_in_bucket(str(dirpath), pattern)
    for path in list_checkpoints(dirpath, pattern):
        verdict = verified_once_per_node(path)
        if not verdict:
            rank_zero_warn(f"Skipping checkpoint {path}: {verdict.reason}")
            continue
        if verdict.checked_by == "zip":
            rank_zero_warn(f"Resuming from {path} although it has {verdict.reason}")
        log.info("resuming from %s", path)
        return str(path)
    return None
