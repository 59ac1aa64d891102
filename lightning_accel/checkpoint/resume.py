"""Find the newest checkpoint that is complete, skipping truncated or corrupt ones."""

from __future__ import annotations

import logging
from pathlib import Path

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities import rank_zero_warn

from lightning_accel.checkpoint.atomic import TMP_MARKER, read_manifest, verify

log = logging.getLogger(__name__)


def _order_key(path: Path) -> tuple[int, float]:
    manifest = read_manifest(path) or {}
    step = manifest.get("global_step")
    return (int(step) if isinstance(step, int) else -1, path.stat().st_mtime)


def list_checkpoints(dirpath: _PATH, pattern: str = "*.ckpt") -> list[Path]:
    """Checkpoint files in ``dirpath``, newest first (by recorded global step, then modification time)."""
    folder = Path(dirpath)
    if not folder.is_dir():
        return []
    files = [p for p in folder.glob(pattern) if p.is_file() and TMP_MARKER not in p.name]
    return sorted(files, key=_order_key, reverse=True)


def find_resume_checkpoint(dirpath: _PATH, pattern: str = "*.ckpt") -> str | None:
    """Path of the newest valid checkpoint in ``dirpath``, or ``None`` to start fresh.

    Use as ``trainer.fit(model, ckpt_path=find_resume_checkpoint("checkpoints"))``; invalid files are
    skipped with a warning naming the reason, never deleted.
    """
    for path in list_checkpoints(dirpath, pattern):
        problem = verify(path)
        if problem is None:
            log.info("resuming from %s", path)
            return str(path)
        rank_zero_warn(f"Skipping checkpoint {path}: {problem}")
    return None
