"""Where a :class:`PreemptionCheckpoint` puts its checkpoints: a local folder, or a bucket through a staging folder.

One object answers the questions the callback asks of either: where to write on this machine
(:attr:`Destination.local_dir`), whether that and the store can be written now (:meth:`Destination.check_writable`,
at fit start), what to do with a written checkpoint (:meth:`Destination.published`), and, for a bucket, how long to
wait for uploads at a preemption's deadline and at the end of a fit.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning_accel.checkpoint.bucket import BucketPublisher
from lightning_accel.checkpoint.durable import TMP_MARKER, PathLike
from lightning_accel.checkpoint.sharded import ranks_share_folder, writes_folders
from lightning_accel.storage import (
    CACHE_ENV,
    OutageLog,
    StoreError,
    check_storage_url,
    download_tree,
    filesystem,
    is_remote,
    join,
    redact,
    retrying,
    staging_dir,
    upload,
)

__all__ = ["EXIT_MARGIN_S", "FINAL_UPLOAD_TIMEOUT_S", "Destination", "is_run_file"]

log = logging.getLogger(__name__)

# Seconds kept free before a preemption's deadline for the exit itself (barrier, teardown, process exit).
EXIT_MARGIN_S = 2.0
# How long a fit that ended waits for its last uploads to reach a store that does not answer before it fails.
FINAL_UPLOAD_TIMEOUT_S = 600.0


def is_run_file(rel: str) -> bool:
    """Whether a path in the run folder (relative) is a run file to keep beside the checkpoints in a bucket: not a
    checkpoint, its manifest or a folder of one, and not a hidden temporary, lock or marker file."""
    first = rel.split("/", 1)[0]
    return ".ckpt" not in first and not any(part.startswith(".") for part in rel.split("/"))


class Destination:
    """``dirpath`` as given: a local folder, or an object-store URL (checked now: an unknown scheme or a missing
    backend is one line naming the fix, never a local folder named ``s3:``)."""

    def __init__(self, dirpath: PathLike) -> None:
        check_storage_url(dirpath)
        self.url: str | None = str(dirpath).rstrip("/") if is_remote(dirpath) else None
        self.dirpath: str | Path = self.url or Path(dirpath)
        self.publisher: BucketPublisher | None = None  # uploads to the bucket (global rank 0 only)

    @property
    def local_dir(self) -> Path:
        """Where checkpoints are written on this machine: the folder, or the staging folder of a bucket URL."""
        return staging_dir(self.url) if self.url is not None else Path(self.dirpath)

    @property
    def durable(self) -> list[str]:
        """URLs of the checkpoints confirmed in the store this fit, oldest first (empty for a local folder)."""
        return [p.url for p in self.publisher.durable if p.url] if self.publisher is not None else []

    def check_writable(self, trainer: Any, run_id: str, keep_last: int | None, grace_period_s: float) -> None:
        """Refuse now, before any training, a folder or store this run cannot write to (every rank raises)."""
        local_error, store_error = None, None
        if trainer.is_global_zero:
            local_error = _local_write_error(self.local_dir)
            for stale in self.local_dir.glob(f".*{TMP_MARKER}*"):  # left by a write that was killed
                stale.unlink(missing_ok=True)
            if local_error is None and self.url is not None:
                self.publisher = BucketPublisher(self.url, keep_last, grace_period_s)
                store_error = self._probe_and_fetch(run_id)
        local_error, store_error = trainer.strategy.broadcast((local_error, store_error), src=0)
        if local_error is not None:
            raise OSError(local_error)
        if store_error is not None:
            self.close(cancel=True)
            raise StoreError(store_error)
        if trainer.world_size > 1 and writes_folders(trainer.strategy):
            if not ranks_share_folder(trainer.strategy, trainer.is_global_zero, self.local_dir):
                self.close(cancel=True)
                raise OSError(self._unshared_folder_error(trainer))

    def _unshared_folder_error(self, trainer: Any) -> str:
        strategy = type(trainer.strategy).__name__
        common = (
            f"PreemptionCheckpoint: {strategy} saves a folder of shards, every rank its own, but some ranks do not "
            f"see the files rank 0 writes in {self.local_dir} (they run on another machine): rank 0 would "
            f"{'upload' if self.url else 'seal'} checkpoints without their shards. "
        )
        if self.url is not None:
            return common + (
                f"A bucket's checkpoints are staged in a node-local folder ({CACHE_ENV}) and uploaded by rank 0; "
                f"uploading every node's shards is not supported yet. Fix: set {CACHE_ENV} to a folder on a file "
                "system every node mounts, or give dirpath such a folder"
            )
        return common + "Fix: give dirpath a folder on a file system every node mounts (NFS, Lustre, a shared volume)"

    def published(self, path: Path, step: int, write: Any, staged_s: float) -> None:
        """A checkpoint was written at ``path``: queue its upload (bucket, rank 0)."""
        if self.publisher is not None:
            self.publisher.submit(path, step, write, staged_s)

    def _probe_and_fetch(self, run_id: str) -> str | None:
        """Rank 0: the store's fit-start probe (:meth:`BucketPublisher.check_writable`), with the run's files fetched
        meanwhile (both wait on the store: one wait at fit start instead of two). The probe's error, if any."""
        assert self.publisher is not None
        store_error = None
        with ThreadPoolExecutor(1, thread_name_prefix="accel-fetch") as pool:
            fetched = pool.submit(self._fetch_run_files)
            try:
                self.publisher.check_writable(run_id)
            except StoreError as err:
                store_error = str(err)
            fetch_error = fetched.result()
        if store_error is not None:
            return store_error  # (the fetch's own error is the same outage: not said twice)
        if fetch_error is not None:  # the store answers now (the probe got through, maybe after retries): once more
            fetch_error = self._fetch_run_files()
        if fetch_error is not None:
            log.warning("could not fetch this run's files from %s (%s): lost work is not counted", *fetch_error)
        return None

    def _fetch_run_files(self) -> tuple[str, str] | None:
        """An empty machine resuming from the bucket gets the run's files (the progress file a resumed attempt reads
        to count the work it redoes, the last goodput.json) that it does not have yet. ``(store, error)`` when the
        store did not give them."""
        fs, root = filesystem(self.url or "")
        missing = lambda rel: is_run_file(rel) and not (self.local_dir / rel).exists()  # noqa: E731
        try:
            got = download_tree(fs, root, self.local_dir, missing)
        except Exception as err:  # each backend raises its own kinds (aiohttp's connection errors are no OSError)
            return redact(root), f"{type(err).__name__}: {err}"
        if got:
            log.info("fetched %d run file(s) from %s", len(got), redact(self.url or ""))
        return None

    def upload_run_files(self, deadline: float) -> None:
        """Rank 0: put the run files of the local folder (``goodput.json``, the progress file, ``profile/``,
        ``hang/``) beside the checkpoints in the bucket, until ``deadline`` (monotonic)."""
        if self.publisher is None or self.url is None:
            return
        fs, root = self.publisher.fs, self.publisher.root
        outage, checks_crc32 = OutageLog(self.url), self.publisher.store_checks_crc32
        files = [p for p in sorted(self.local_dir.rglob("*")) if p.is_file()]
        for path in files:
            rel = path.relative_to(self.local_dir).as_posix()
            if not is_run_file(rel):
                continue
            if time.monotonic() >= deadline:
                log.warning("run files from %s on stay on local disk only: no time left before the deadline", path)
                return
            try:
                retrying(
                    lambda: upload(fs, path, join(root, rel), checks_crc32),  # noqa: B023 - called at once
                    outage,
                    f"uploading {rel}",
                    deadline=deadline,
                )
            except StoreError as err:
                log.warning("run file %s stays on local disk only: %s", path, err)
                return

    def upload_before_deadline(self, began: float, grace_period_s: float) -> str | None:
        """Rank 0 at a preemption: wait for the queued uploads until ``began + grace_period_s`` less the exit's
        margin; the URL of the newest checkpoint then in the store. A missed deadline keeps the previous one, said
        with the numbers."""
        if self.publisher is None:
            return None
        deadline = began + grace_period_s - EXIT_MARGIN_S
        self.publisher.prefer_newest()
        queued = self.publisher.pending_steps()
        in_time = self.publisher.wait(deadline)
        newest = self.publisher.newest()
        left = deadline + EXIT_MARGIN_S - time.monotonic()
        if not in_time:
            log.error(
                "the upload of checkpoint step=%d did not reach %s within the %g s grace period (%.1f s left): the "
                "bucket keeps %s, and the run resumes from it; the local copy stays in %s",
                queued[-1],
                redact(self.url or ""),
                grace_period_s,
                left,
                f"step={newest.step}" if newest else "no checkpoint of this fit",
                self.local_dir,
            )
        else:  # run files only when the store took the checkpoint in time: a stalled call would outlast the deadline
            if queued:
                log.warning("checkpoint step=%d is in the store with %.1f s of the grace period left", queued[-1], left)
            self.upload_run_files(deadline)
        return newest.url if newest else None

    def finish(self) -> None:
        """Rank 0, at the end of a fit: every checkpoint written reaches the store before ``fit`` returns."""
        if self.publisher is None:
            return
        try:
            deadline = time.monotonic() + FINAL_UPLOAD_TIMEOUT_S
            if not self.publisher.wait(deadline):
                raise StoreError(
                    f"the last checkpoints did not reach {redact(self.url or '')} within {FINAL_UPLOAD_TIMEOUT_S:g} "
                    f"s (the store does not answer); they are kept in {self.local_dir}: upload them by hand, or "
                    "resume from the bucket's newest complete checkpoint"
                )
            self.upload_run_files(deadline)
        finally:
            self.close(cancel=True)

    def close(self, cancel: bool) -> None:
        if self.publisher is not None:
            self.publisher.close(cancel=cancel)


def _local_write_error(folder: Path) -> str | None:
    """``None`` when ``folder`` can be created and written to now; else one line naming it, the error and the fix."""
    probe = folder / f".lightning_accel-probe{TMP_MARKER}{uuid.uuid4().hex}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        return (
            f"PreemptionCheckpoint cannot write checkpoints to {folder}: {err.strerror or err}. Fix: give dirpath a "
            "folder this user may write to (or fix its permissions, or free space on its file system)"
        )
    return None
