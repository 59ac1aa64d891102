"""Checkpoints in an object store: staged on local disk, uploaded in the background, published by a manifest last.

A checkpoint is written to a local staging folder first (``storage.node_cache.staging_dir``) by the same atomic
IO as a local one, so training stalls only for the local save. :class:`BucketPublisher` then uploads it from a
background thread: the checkpoint's objects first, each confirmed in the store with its size and checksum, then
its manifest, the one object that makes it count. A reader that finds no manifest (an upload cut off by SIGKILL
or an outage) never picks it: the bucket's newest complete checkpoint stays the previous one. There is no rename
in an object store, and none is needed.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_accel.checkpoint.bucket_listing import list_bucket_manifests
from lightning_accel.checkpoint.durable import MANIFEST_SUFFIX, manifest_path, parse_manifest
from lightning_accel.checkpoint.sharded import folder_files
from lightning_accel.storage import (
    Backoff,
    OutageLog,
    StoreError,
    abort_stale_uploads,
    filesystem,
    for_uploads,
    join,
    redact,
    remove_objects,
    retrying,
    store_checks_crc32,
    upload,
)

__all__ = ["BucketPublisher", "Publication"]

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 20.0  # how long fit start waits for an unreachable store before refusing to train
RETRY_BACKOFF_S = (0.5, 30.0)  # an upload's retries: the first wait, doubled up to the cap


class _Serial:
    """Calls run one at a time, in order, on a daemon thread started at the first. Not an executor: a call stuck on
    a store that stopped answering must not hold the process past its exit (the interpreter joins an executor's
    threads, and SIGKILL would then come first)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._todo: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any, future: Future[Any] | None = None) -> Future[Any]:
        future = future or Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._todo.put((fn, args, future))
        return future

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            fn, args, future = item
            try:
                future.set_result(fn(*args))
            except BaseException as err:
                future.set_exception(err)

    def close(self, join: bool) -> None:
        """Stop once the calls queued are done (``join``: wait for them)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._todo.put(None)
            if join:
                thread.join()


@dataclass
class Publication:
    """One checkpoint on its way to the bucket; ``url`` once its manifest is in the store."""

    local: Path
    step: int
    write: Any = None  # the local background write (an async_io.AsyncWrite), when async_save
    staged_s: float = 0.0  # the local save's seconds (stall, plus the write when async)
    submitted: float = field(default_factory=time.monotonic)
    future: Future[None] = field(default_factory=Future)
    url: str | None = None
    upload_s: float | None = None
    bytes: int = 0


class BucketPublisher:
    """Uploads a :class:`PreemptionCheckpoint`'s staged checkpoints to ``url`` and keeps the bucket to ``keep_last``.

    One upload at a time, in order. A store that does not answer is retried with backoff while training goes on
    (logged once); a checkpoint overtaken by a newer one before it reached the store is given up, with a log line.
    When uploads fall behind the saves (a slow link), a queued checkpoint with ``keep_last`` newer ones queued behind
    it is not uploaded at all: retention would delete it as soon as they are in the store, so the bucket ends the same
    and the newest checkpoint gets there sooner. After :meth:`prefer_newest` (a preemption) only the newest queued
    one goes up. :meth:`wait` bounds the wait for the newest one (a preemption's deadline).
    """

    def __init__(self, url: str, keep_last: int | None, grace_period_s: float, backoff: Backoff | None = None) -> None:
        self.url = url.rstrip("/")
        fs, self.root = filesystem(self.url)
        self.fs = for_uploads(fs)
        self.keep_last, self.grace_period_s = keep_last, grace_period_s
        self.backoff = backoff or Backoff(*RETRY_BACKOFF_S)
        self.outage = OutageLog(self.url)
        self.durable: list[Publication] = []  # confirmed in the store, oldest first
        self._queue: list[Publication] = []
        self._uploads = _Serial("accel-upload")
        # retention runs beside the next upload, not before it: it deletes only what a confirmed newer one replaced
        self._retention = _Serial("accel-retention")
        self._pruning: list[Future[None]] = []
        self._lock = threading.Lock()
        self._warned_slow = False
        self._warned_behind = False
        self._ours: dict[str, tuple[int, bool]] | None = None  # this run's checkpoints in the bucket: step, folder?
        self.store_checks_crc32 = False  # asked at fit start (check_writable): how an upload is confirmed
        self.cancelled = False
        self._newest_only = False  # set at a preemption: the queued checkpoints before the newest are not uploaded

    # -- fit start ---------------------------------------------------------------------------------------------
    def check_writable(self, run_id: str) -> None:
        """Write and delete a probe object (on S3, the one that asks whether the store checks CRC32s), and abort
        multipart uploads a killed process left; raise a clear :class:`StoreError` (naming the store, the error and
        the fixes) when the store refuses or is unreachable."""
        probe = join(self.root, f".lightning_accel-probe-{run_id}")
        deadline = time.monotonic() + PROBE_TIMEOUT_S

        def write_probe() -> None:
            if hasattr(self.fs, "call_s3"):
                self.store_checks_crc32 = store_checks_crc32(self.fs, probe)
                return
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)

        # the stale uploads are listed while the probe waits on the store (one wait at fit start, not two)
        with ThreadPoolExecutor(1, thread_name_prefix="accel-stale") as pool:
            stale = pool.submit(abort_stale_uploads, self.fs, self.root)
            try:
                retrying(
                    write_probe,
                    self.outage,
                    "writing a probe object",
                    deadline=deadline,
                    backoff=Backoff(0.5, 4),
                    final=(FileNotFoundError, PermissionError),  # no such bucket, no right to write: no use waiting
                )
                if stale.exception() is not None:  # the store answers now (the probe got through): once more
                    abort_stale_uploads(self.fs, self.root)
            except (StoreError, OSError) as err:
                raise StoreError(
                    f"PreemptionCheckpoint cannot write to {redact(self.url)}: {err}. Check that the bucket exists, "
                    "that this machine's credentials may write to it (the backend's standard chain: AWS_* variables, "
                    "profile or instance role; GCP application default credentials; AZURE_STORAGE_* variables) and, "
                    "for an S3-compatible server, AWS_ENDPOINT_URL"
                ) from None
        if hasattr(self.fs, "call_s3") and not self.store_checks_crc32:
            log.info(
                "object store %s does not check the CRC32 sent with an upload (moto, some S3-compatible servers): "
                "each upload is confirmed by the MD5 in the store's ETag instead (one more pass over each file)",
                redact(self.url),
            )

    # -- uploads -----------------------------------------------------------------------------------------------
    def submit(self, local: Path, step: int, write: Any, staged_s: float) -> Publication:
        """Queue the checkpoint staged at ``local`` (its background write ``write``, if any) for upload."""
        pub = Publication(local, step, write, staged_s, future=Future())
        with self._lock:
            self._queue.append(pub)
        self._uploads.submit(self._publish, pub, future=pub.future)
        return pub

    def pending_steps(self) -> list[int]:
        """Steps of the checkpoints queued or uploading, oldest first."""
        with self._lock:
            return [pub.step for pub in self._queue]

    def prefer_newest(self) -> None:
        """From now on, of the checkpoints queued and not yet uploading, only the newest goes up (a preemption: the
        one the restart needs, first; an upload already under way finishes)."""
        self._newest_only = True

    def _newer(self, pub: Publication) -> int:
        """How many checkpoints are queued behind ``pub`` (0 once it has left the queue)."""
        with self._lock:
            return len(self._queue) - 1 - self._queue.index(pub) if pub in self._queue else 0

    def _superseded(self, pub: Publication) -> bool:
        return self.cancelled or self._newer(pub) > 0

    def _needless(self, pub: Publication) -> int:
        """How many newer checkpoints are queued behind ``pub`` when that makes its upload needless (0 when not):
        ``keep_last`` of them (retention would delete it once they are in the store), or any after
        :meth:`prefer_newest`. Never the newest: the queue always makes progress."""
        newer = self._newer(pub)
        if newer and (self._newest_only or (self.keep_last is not None and newer >= self.keep_last)):
            return newer
        return 0

    def _publish(self, pub: Publication) -> None:
        try:
            if newer := self._needless(pub):
                log.info(
                    "checkpoint step=%d is not uploaded to %s: %d newer one(s) are queued behind it (%s)",
                    pub.step,
                    redact(self.url),
                    newer,
                    "a preemption: the newest goes first"
                    if self._newest_only
                    else f"keep_last={self.keep_last} would delete it once they are in the store",
                )
                if not self._newest_only:
                    self._warn_behind(pub, newer)
                return
            if pub.write is not None and pub.write.future is not None:
                pub.write.future.result()  # durable on local disk first (a failed write is the writer's error)
                pub.staged_s = pub.write.seconds or pub.staged_s
            started = time.monotonic()
            name = pub.local.name
            objects = [(pub.local, join(self.root, name))]
            if pub.local.is_dir():
                objects = [
                    (p, join(self.root, name, p.relative_to(pub.local).as_posix())) for p in folder_files(pub.local)
                ]
            # the manifest goes last: until it is confirmed in the store, the checkpoint does not count
            objects.append((manifest_path(pub.local), join(self.root, name + MANIFEST_SUFFIX)))
            for local, remote in objects:
                if self.cancelled:  # given up at a missed deadline: no object after that, least of all the manifest
                    raise StoreError(f"the upload of {name} was given up")
                retrying(
                    lambda: upload(self.fs, local, remote, self.store_checks_crc32),  # noqa: B023 - called at once
                    self.outage,
                    f"uploading {name}",
                    backoff=self.backoff,
                    give_up=lambda: self._superseded(pub),
                )
            pub.upload_s = time.monotonic() - started
            pub.bytes = sum(p.stat().st_size for p, _ in objects)
            pub.url = join(self.url, name)
            with self._lock:
                self.durable.append(pub)
            log.info(
                "checkpoint %s is in the store (%.1f MB in %.2f s)", redact(pub.url), pub.bytes / 1e6, pub.upload_s
            )
            self._warn_if_slow(pub)
            with self._lock:  # (before the queue lets go of it: whoever waits for the queue waits for this too)
                self._pruning.append(self._retention.submit(self.prune, pub))
        except StoreError as err:
            if not self.cancelled:
                log.warning(
                    "checkpoint step=%d did not reach %s before a newer one replaced it (%s); the newer one goes up "
                    "instead",
                    pub.step,
                    redact(self.url),
                    err,
                )
            return
        finally:
            with self._lock:
                if pub in self._queue:
                    self._queue.remove(pub)

    def _warn_behind(self, pub: Publication, newer: int) -> None:
        """Once per fit: uploads do not keep up with the saves, so the bucket lags training."""
        if self._warned_behind:
            return
        self._warned_behind = True
        last = self.newest()
        took = f" (the last one took {last.upload_s:.1f} s)" if last is not None and last.upload_s else ""
        rank_zero_warn(
            f"PreemptionCheckpoint: uploads to {redact(self.url)} fall behind the saves: {newer} newer checkpoints "
            f"were saved while step={pub.step} waited for its upload{took}. The ones keep_last would delete at once "
            "are left out, so the bucket ends the same, and a SIGTERM or cloud notice still uploads the newest first. "
            "But a machine lost without warning loses the work since the newest checkpoint in the store, which lags "
            "the last save. Fixes: save less often (every_n_steps / every_n_seconds), a bucket in the same region, or "
            "a smaller checkpoint."
        )

    def _warn_if_slow(self, pub: Publication) -> None:
        total = pub.staged_s + (pub.upload_s or 0.0)
        if self._warned_slow or total <= self.grace_period_s:
            return
        self._warned_slow = True
        rate = pub.bytes / max(pub.upload_s or 1e-9, 1e-9) / 1e6
        rank_zero_warn(
            f"PreemptionCheckpoint: a save took {pub.staged_s:.1f} s to local disk and {pub.upload_s:.1f} s to "
            f"upload {pub.bytes / 1e6:.1f} MB to {redact(self.url)} ({rate:.1f} MB/s): {total:.1f} s, over the "
            f"{self.grace_period_s:g} s a preemption leaves (grace_period_s, or the cloud notice's lead). A save at "
            "the signal would not reach the store; the bucket would keep the previous checkpoint. Fixes: periodic "
            "saves (every_n_steps / every_n_seconds, with async_save=True) so less is lost; a bucket in the same "
            "region; a longer grace period where you can set one."
        )

    def wait(self, deadline: float | None = None) -> bool:
        """Wait for every queued upload (until ``deadline``, monotonic); ``True`` when the newest one is durable."""
        with self._lock:
            pending = list(self._queue)
        for pub in pending:
            try:
                pub.future.result(timeout=_left(deadline))
            except FutureTimeout:
                return False
            except Exception as err:
                log.warning("checkpoint step=%d was not uploaded: %s: %s", pub.step, type(err).__name__, err)
        with self._lock:
            pruning, self._pruning = self._pruning, []
        for future in pruning:  # retention of the uploads done: within the deadline, never instead of them
            try:
                future.result(timeout=_left(deadline))
            except FutureTimeout:
                break
            except Exception as err:
                log.warning("retention in %s failed: %s: %s", redact(self.url), type(err).__name__, err)
        return not pending or pending[-1].url is not None

    def newest(self) -> Publication | None:
        with self._lock:
            return self.durable[-1] if self.durable else None

    def close(self, cancel: bool = False) -> None:
        """Stop the upload thread once the queue is done (``cancel``: give up the uploads still queued, as at a
        missed deadline; an upload in a store's call finishes or fails in the background)."""
        self.cancelled = self.cancelled or cancel
        self._uploads.close(join=not cancel)
        self._retention.close(join=not cancel)

    # -- retention ---------------------------------------------------------------------------------------------
    def prune(self, newest: Publication) -> None:
        """Delete this run's checkpoints in the bucket beyond ``keep_last`` and the staged local copies older than
        ``newest``. A checkpoint file goes with its manifest in one request where the store takes one (S3's
        DeleteObjects), else the manifest goes first; either way a reader never trusts a manifest without its objects.
        The bucket is listed once per fit (for the checkpoints earlier attempts of the run left); after that this
        publisher's own uploads are all it adds."""
        for path in newest.local.parent.glob("step=*.ckpt"):
            if path.name < newest.local.name:
                _remove_local(path)
        if self.keep_last is None:
            return
        if self._ours is None:
            run_id = _run_id(newest.local)
            try:
                listed = list_bucket_manifests(self.fs, self.root)
            except OSError as err:
                self.outage.failed(err, "listing checkpoints to prune")
                return
            self._ours = {
                name: (step, m.get("kind") == "folder") for step, name, m in listed if m.get("run_id") == run_id
            }
        self._ours[newest.local.name] = (newest.step, newest.local.is_dir())
        for name in sorted(self._ours, key=lambda n: self._ours[n][0], reverse=True)[self.keep_last :]:  # type: ignore[index]
            folder = self._ours[name][1]
            manifest = join(self.root, name + MANIFEST_SUFFIX)
            try:
                if folder:
                    self.fs.rm_file(manifest)
                    self.fs.rm(join(self.root, name), recursive=True)
                else:
                    remove_objects(self.fs, [manifest, join(self.root, name)])
            except OSError as err:
                self.outage.failed(err, f"deleting {name}")
                continue
            del self._ours[name]


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _run_id(local: Path) -> str | None:
    manifest = parse_manifest(manifest_path(local).read_bytes()) if manifest_path(local).is_file() else None
    return (manifest or {}).get("run_id")


def _remove_local(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    manifest_path(path).unlink(missing_ok=True)
