"""Checkpoints in an object store: staged on local disk, uploaded in the background, published by a manifest last.

A checkpoint is written to a local staging folder first (``storage.node_cache.staging_dir``) by the same atomic
IO as a local one, so training stalls only for the local save. :class:`BucketPublisher` then uploads it from a
background thread: the checkpoint's objects first, each confirmed in the store with its size and checksum, then
its manifest, the one object that makes it count. A reader that finds no manifest (an upload cut off by SIGKILL
or an outage) never picks it: the bucket's newest complete checkpoint stays the previous one. There is no rename
in an object store, and none is needed.
"""

from __future__ import annotations

import fnmatch
import logging
import queue
import shutil
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

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
from lightning_accel.storage.shards import folder_entries

__all__ = ["BucketPublisher", "Publication", "confirm_objects", "list_bucket_manifests"]

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 20.0  # how long fit start waits for an unreachable store before refusing to train
RETRY_BACKOFF_S = (0.5, 30.0)  # an upload's retries: the first wait, doubled up to the cap


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
    :meth:`wait` bounds the wait for the newest one (a preemption's deadline).
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
        self._todo: queue.Queue[Publication | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        self._warned_slow = False
        self._ours: dict[str, tuple[int, bool]] | None = None  # this run's checkpoints in the bucket: step, folder?
        self.store_checks_crc32 = False  # asked at fit start (check_writable): how an upload is confirmed
        self.cancelled = False

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

        try:
            retrying(
                write_probe,
                self.outage,
                "writing a probe object",
                deadline=deadline,
                backoff=Backoff(0.5, 4),
                final=(FileNotFoundError, PermissionError),  # no such bucket, no right to write: no use waiting
            )
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
            if self._worker is None:
                # a daemon thread, not an executor: an upload stuck on a dead store must not hold the process
                # past its exit (the interpreter joins executor threads, and SIGKILL would then come first)
                self._worker = threading.Thread(target=self._work, name="accel-upload", daemon=True)
                self._worker.start()
        self._todo.put(pub)
        return pub

    def pending_steps(self) -> list[int]:
        """Steps of the checkpoints queued or uploading, oldest first."""
        with self._lock:
            return [pub.step for pub in self._queue]

    def _work(self) -> None:
        while (pub := self._todo.get()) is not None:
            try:
                self._publish(pub)
            except BaseException as err:
                pub.future.set_exception(err)
            else:
                pub.future.set_result(None)

    def _superseded(self, pub: Publication) -> bool:
        with self._lock:
            return self.cancelled or (bool(self._queue) and self._queue[-1] is not pub and pub in self._queue)

    def _publish(self, pub: Publication) -> None:
        try:
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
            # before the queue lets go of it: whoever waits for the queue (the end of a fit) waits for retention
            self.prune(pub)
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
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                pub.future.result(timeout=timeout)
            except FutureTimeout:
                return False
            except Exception as err:
                log.warning("checkpoint step=%d was not uploaded: %s: %s", pub.step, type(err).__name__, err)
        return not pending or pending[-1].url is not None

    def newest(self) -> Publication | None:
        with self._lock:
            return self.durable[-1] if self.durable else None

    def close(self, cancel: bool = False) -> None:
        """Stop the upload thread once the queue is done (``cancel``: give up the uploads still queued, as at a
        missed deadline; an upload in a store's call finishes or fails in the background)."""
        self.cancelled = self.cancelled or cancel
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            self._todo.put(None)
            if not cancel:
                worker.join()

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


def _run_id(local: Path) -> str | None:
    manifest = parse_manifest(manifest_path(local).read_bytes()) if manifest_path(local).is_file() else None
    return (manifest or {}).get("run_id")


def _remove_local(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    manifest_path(path).unlink(missing_ok=True)


def list_bucket_manifests(fs: Any, root: str, pattern: str = "*.ckpt") -> list[tuple[int, str, dict[str, Any]]]:
    """(global step, checkpoint name, manifest) of every checkpoint whose manifest in the bucket can be trusted
    as a manifest; undecodable ones are skipped with a warning."""
    fs.invalidate_cache(root)
    found = []
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []
    for manifest_name in names:
        if not manifest_name.endswith(MANIFEST_SUFFIX):
            continue
        name = manifest_name[: -len(MANIFEST_SUFFIX)]
        if not fnmatch.fnmatch(name, pattern):
            continue
        manifest = parse_manifest(fs.cat_file(join(root, manifest_name)))
        if manifest is None:
            rank_zero_warn(f"Skipping checkpoint {name} in {redact(root)}: its manifest is not readable JSON")
            continue
        step = manifest.get("global_step")
        found.append((step if isinstance(step, int) else -1, name, manifest))
    return found


def confirm_objects(fs: Any, root: str, name: str, manifest: dict[str, Any]) -> str | None:
    """``None`` when every object the manifest names is in the store with its size; else what is wrong."""
    try:
        if manifest.get("kind") == "folder":
            entries = folder_entries(manifest)
            if entries is None:
                return "its manifest's list of files is not one of ours (not trusted)"
            for rel, entry in entries.items():
                size = fs.info(join(root, name, rel)).get("size")
                if size != entry["bytes"]:
                    return f"{rel}: {size} bytes in the store, {entry['bytes']} in the manifest"
            return None
        size = fs.info(join(root, name)).get("size")
    except FileNotFoundError:
        return "an object the manifest names is missing from the store"
    return None if size == manifest.get("bytes") else f"{size} bytes in the store, {manifest.get('bytes')} recorded"
