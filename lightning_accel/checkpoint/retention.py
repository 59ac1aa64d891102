"""Keep the newest N complete checkpoints of one run; never touch another run's files or a write in flight."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from lightning_accel.checkpoint.atomic import AtomicCheckpointIO
from lightning_accel.checkpoint.durable import manifest_path, read_manifest
from lightning_accel.checkpoint.resume import list_checkpoints
from lightning_accel.checkpoint.verify import verify

__all__ = ["KeepLast"]

log = logging.getLogger(__name__)


class KeepLast:
    """Prune a folder to the ``keep_last`` newest valid checkpoints whose manifest names the run.

    Only complete checkpoints count: one whose manifest is not written yet (an async write renames the file
    before it writes the manifest) is neither kept nor deleted. Each kept file is verified once (cached by
    size and modification time), so a corrupted newest file of the right size never pushes out good ones.
    """

    def __init__(self, keep_last: int | None, pattern: str = "step=*.ckpt") -> None:
        self.keep_last, self.pattern = keep_last, pattern
        self._verified: dict[tuple[str, int, int], bool] = {}

    def reset(self) -> None:
        self._verified.clear()

    def is_valid(self, path: Path, io: Any = None) -> bool:
        # A file our own IO wrote, unchanged since, was checksummed from the bytes written: no second read.
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in self._verified and isinstance(io, AtomicCheckpointIO) and io.wrote(path):
            self._verified[key] = True
        if key not in self._verified:
            verdict = verify(path)
            if not verdict:
                log.warning("checkpoint %s does not count towards keep_last: %s", path, verdict.reason)
            self._verified[key] = bool(verdict)
        return self._verified[key]

    def prune(self, dirpath: Path, run_id: str, io: Any = None) -> None:
        """Delete run ``run_id``'s checkpoints in ``dirpath`` past the newest ``keep_last`` valid ones (one rank)."""
        if self.keep_last is None:
            return
        io = getattr(io, "checkpoint_io", io)  # ours inside Lightning's AsyncCheckpointIO too
        ours = [p for p in list_checkpoints(dirpath, self.pattern) if (read_manifest(p) or {}).get("run_id") == run_id]
        kept = 0
        for path in ours:
            if kept < self.keep_last:
                kept += self.is_valid(path, io)
                continue
            if isinstance(io, AtomicCheckpointIO):
                io.remove_checkpoint(path)  # async: queued behind the write in flight, off the training thread
            else:  # a checkpoint IO of the user's
                if path.is_dir():  # a sharded folder
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                manifest_path(path).unlink(missing_ok=True)
