"""Moving files between local disk and an object store, each confirmed before anything counts on it.

An upload is confirmed when the store reports the object with the local file's size and, where the store exposes
one, the same checksum: S3's ETag (the MD5 of a single-part object, or the MD5 of the parts' MD5s for a multipart
one), GCS's ``md5Hash``, Azure's ``content_md5``. An S3 store that checks the CRC32 sent with an upload (S3 itself;
:func:`store_checks_crc32` asks) is given the staged file's, and its answer confirms the bytes it received; one that
keeps whatever it is sent (moto) is held to the MD5 in its ETag. Callers retry through ``retries.py``.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import io
import logging
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from fsspec import AbstractFileSystem

from lightning_accel.storage.retries import BUGS, StoreError
from lightning_accel.storage.urls import redact

__all__ = [
    "abort_stale_uploads",
    "confirm_upload",
    "download",
    "download_tree",
    "for_uploads",
    "remove_objects",
    "store_checks_crc32",
    "upload",
]

log = logging.getLogger(__name__)

# s3fs uploads in parts of this size (its own default, passed explicitly so the multipart ETag can be recomputed)
PART_BYTES = 50 * 2**20
# Files up to this size (a manifest, a run file) go up from memory, without the "100 Continue" round trip botocore asks
# for before every PutObject body (for_uploads): on a real network that round trip was half of a manifest's upload.
SMALL_BYTES = 2**20


CRC_PROBE_BODY = b"does this store check the CRC32 it is sent?"


def _md5_of(path: Path, multipart: bool, stop: threading.Event | None = None) -> str:
    """The MD5 the store reports for ``path``: of the whole file, or (``multipart``) S3's multipart ETag for it
    uploaded in ``PART_BYTES`` parts (the MD5 of the parts' MD5s, then ``-<parts>``). One read either way; ``stop``
    set ends it at the next part (its value is then no one's)."""
    whole, parts = hashlib.md5(usedforsecurity=False), []
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(PART_BYTES), b""):
            if stop is not None and stop.is_set():
                return ""
            if multipart:
                parts.append(hashlib.md5(chunk, usedforsecurity=False).digest())
            else:
                whole.update(chunk)
    if not multipart:
        return whole.hexdigest()
    return hashlib.md5(b"".join(parts), usedforsecurity=False).hexdigest() + f"-{len(parts)}"


@contextmanager
def _md5_meanwhile(path: Path, multipart: bool) -> Iterator[Future[str]]:
    """:func:`_md5_of` ``path`` on a thread of its own while the block sends it (hashlib lets go of the GIL): the
    confirmation then waits for the slower of the two, not for both in turn. A block that fails (the send, or a
    confirmation inside it) stops the hashing at its next part instead of waiting for it."""
    stop, result = threading.Event(), Future()

    def run() -> None:
        try:
            result.set_result(_md5_of(path, multipart, stop))
        except BaseException as err:  # (the file gone: the caller's result() raises it)
            result.set_exception(err)

    # a daemon thread: the hash of a large file never holds the process past its exit (a preemption's deadline)
    threading.Thread(target=run, name="accel-md5", daemon=True).start()
    try:
        yield result
    except BaseException:
        stop.set()
        raise


def _remote_checksum(info: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, value) of a checksum the store reports for an object, or ``None`` when it reports none we can check."""
    content_md5 = (info.get("content_settings") or {}).get("content_md5")  # Azure (its ETag is no MD5)
    if content_md5:
        return "md5", bytes(content_md5).hex()
    md5 = info.get("md5Hash")  # GCS: base64 of the MD5 (absent for composite objects)
    if isinstance(md5, str):
        return "md5", base64.b64decode(md5).hex()
    etag = info.get("ETag") or info.get("etag")  # S3
    if isinstance(etag, str) and etag.strip('"'):
        return "etag", etag.strip('"')
    return None


def _as_s3_crc32(crc: int) -> str:
    """A CRC32 as S3 sends and reports it: base64 of the big-endian 4 bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _crc32_of(path: Path) -> str:
    """The CRC32 of ``path`` as S3 reports it."""
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    return _as_s3_crc32(crc)


def _s3_info(fs: AbstractFileSystem, remote: str) -> dict[str, Any]:
    """S3's HEAD of ``remote`` with its stored checksum: botocore sends a CRC32 with every upload by default and
    the store verifies it on receipt, so comparing it with the file's costs a CRC32 pass, not an MD5 one."""
    bucket, _, key = remote.partition("/")
    head = fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    return {"size": head.get("ContentLength"), "ETag": head.get("ETag"), "crc32": head.get("ChecksumCRC32")}


def confirm_upload(
    fs: AbstractFileSystem,
    remote: str,
    local: Path,
    store_checks_crc32: bool = False,
    multipart_etag: Future[str] | None = None,
) -> None:
    """Raise :class:`StoreError` unless ``remote`` is in the store with ``local``'s size (and checksum, where the
    store reports one: S3's CRC32 where it checks the ones it is sent, else its MD5 ETag; GCS's MD5; Azure's
    Content-MD5). ``multipart_etag``: the S3 multipart ETag of ``local`` in ``PART_BYTES`` parts, computed while
    they were sent (else the file is read again for it)."""
    fs.invalidate_cache(remote)
    info = _s3_info(fs, remote) if hasattr(fs, "call_s3") else fs.info(remote)
    crc32 = info.get("crc32")  # (a store that does not check CRC32s reports the one it was sent: not evidence)
    if store_checks_crc32 and isinstance(crc32, str) and "-" not in crc32 and info.get("size") == local.stat().st_size:
        if crc32 != _crc32_of(local):  # (a multipart object's CRC is composite: its ETag is compared instead)
            raise StoreError(f"{redact(remote)}: the store's CRC32 {crc32} is not the staged file's: not confirmed")
        return
    size = local.stat().st_size
    if info.get("size") != size:
        raise StoreError(f"{redact(remote)} holds {info.get('size')} bytes, the staged file {size}: not confirmed")
    checksum = _remote_checksum(info)
    if checksum is None:
        return
    kind, value = checksum
    if kind == "etag" and "-" not in value and len(value) != 32:
        return  # not an MD5 ETag (a server-side encrypted object): the size was confirmed
    multipart = kind == "etag" and "-" in value
    expected = multipart_etag.result() if multipart and multipart_etag is not None else _md5_of(local, multipart)
    if value != expected:
        raise StoreError(f"{redact(remote)}: the store's checksum {value} is not the staged file's: not confirmed")


def _put_kwargs(fs: AbstractFileSystem) -> dict[str, Any]:
    # s3fs's put_file takes the part size; passing its own default keeps the multipart ETag computable here.
    params = inspect.signature(fs._put_file if hasattr(fs, "_put_file") else fs.put_file).parameters
    return {"chunksize": PART_BYTES} if "chunksize" in params else {}


def for_uploads(fs: AbstractFileSystem) -> AbstractFileSystem:
    """``fs`` for :func:`upload`: on S3, the same store and credentials with botocore's own checksum of a request's
    body left to the requests that require one. An upload here is confirmed end to end without it (the staged
    file's CRC32, checked by the store, or the store's MD5 ETag against the staged file's); botocore's default CRC32
    would be one more pass over each file, and a slow one on a file body (read in Python: about 45 ms per 32 MB on
    this project's 2-core CI machine). Downloads are checked by botocore as before (a separate setting).

    Its client also sends a small body (up to ``SMALL_BYTES``: a manifest, a run file) without first asking the store
    for "100 Continue": botocore asks before every PutObject body, so that a store can refuse a large one before it
    is sent, and for a small one that is a round trip for nothing (two of a manifest's upload on a real network)."""
    if not hasattr(fs, "call_s3"):
        return fs
    config = {**(fs.storage_options.get("config_kwargs") or {}), "request_checksum_calculation": "when_required"}
    uploads = type(fs)(**{**fs.storage_options, "config_kwargs": config})
    try:
        client = uploads.s3  # (s3fs builds its client here: no request yet)
    except Exception:  # a bad endpoint or configuration: the first call raises it again, where its caller says so
        return uploads
    # after botocore's own handler of the same event (one per client: a unique id registers once)
    client.meta.events.register_last("before-call.s3", _send_small_bodies_at_once, unique_id=_NO_CONTINUE)
    return uploads


_NO_CONTINUE = "lightning_accel.send-small-bodies-at-once"


def _send_small_bodies_at_once(model: Any, params: dict[str, Any], **_: Any) -> None:
    body = params.get("body")
    if model.name == "PutObject" and isinstance(body, io.BytesIO) and len(body.getbuffer()) <= SMALL_BYTES:
        params["headers"].pop("Expect", None)


def store_checks_crc32(fs: AbstractFileSystem, probe: str) -> bool:
    """Whether the S3 store behind ``fs`` refuses an object whose body does not match the CRC32 sent with it, as S3
    does; its answer to an upload then confirms the bytes it received. moto, for one, keeps such an object and
    reports the CRC32 it was sent: its answers are no evidence, and its uploads are held to their MD5 ETag instead.

    ``probe`` names the keys to test with: sent with a wrong CRC32 (``<probe>-wrong-crc32``) the object must be
    refused for its checksum, and with the right one (``<probe>-right-crc32``) taken; a store that refuses every
    CRC32 header checks none. Both go at once and are deleted in one request (:func:`remove_objects`, retention's
    own), so this is also the proof that the store takes writes and deletes: its errors (no bucket, no right, no
    answer) are raised. ``False`` for other stores: the MD5 path is slower, never less sure."""
    if not hasattr(fs, "call_s3"):
        return False
    bucket, _, key = probe.partition("/")
    wrong, right = f"{key}-wrong-crc32", f"{key}-right-crc32"

    def put(name: str, crc32: str) -> None:
        kwargs = {"Body": CRC_PROBE_BODY, "ChecksumAlgorithm": "CRC32", "ChecksumCRC32": crc32}
        fs.call_s3("put_object", Bucket=bucket, Key=name, **kwargs)

    # both at once (one round trip to the store, not two: fit start waits for this), each under its own key
    with ThreadPoolExecutor(2, thread_name_prefix="accel-probe") as pool:
        sent = [
            pool.submit(put, wrong, _as_s3_crc32(0)),
            pool.submit(put, right, _as_s3_crc32(zlib.crc32(CRC_PROBE_BODY))),
        ]
    wrong_error, right_error = (future.exception() for future in sent)
    written = [f"{bucket}/{wrong}", f"{bucket}/{right}"]
    for error in (wrong_error, right_error):  # no bucket, no right to write, no answer: raised
        if error is not None and not _refused_for_its_checksum(error):
            if wrong_error is None or right_error is None:  # one was written (a store that failed both has none)
                _remove_quietly(fs, written)
            raise error
    checks = wrong_error is not None and right_error is None  # the wrong CRC32 refused, the right one taken
    if wrong_error is not None and right_error is not None:  # every CRC32 header refused: it checks none
        fs.pipe_file(probe, CRC_PROBE_BODY)
        written.append(probe)
    remove_objects(fs, written)  # (a key never written counts as deleted)
    return checks


def _remove_quietly(fs: AbstractFileSystem, paths: list[str]) -> None:
    """Delete what a failed probe may have written, keeping the probe's own error the one raised."""
    try:
        remove_objects(fs, paths)
    except Exception as err:  # the store's error is already on its way to the caller
        log.debug("could not delete the probe objects %s: %s", [redact(p) for p in paths], err)


def _refused_for_its_checksum(err: Exception) -> bool:
    said = " ".join(str(e) for e in (err, err.__cause__, err.__context__) if e is not None).lower()
    # S3's BadDigest, MinIO's XAmzContentChecksumMismatch; a bug of ours is never one
    return not isinstance(err, BUGS) and ("digest" in said or "checksum" in said)


def upload(fs: AbstractFileSystem, local: Path, remote: str, store_checks_crc32: bool = False) -> None:
    """Put ``local`` at ``remote`` and confirm it (one try; callers retry through :func:`retrying`).

    s3fs aborts its multipart upload when a part fails, so a failed try leaves no parts behind; parts left by a
    process that was killed mid-upload are aborted by :func:`abort_stale_uploads` at the next start. An S3 object of
    one part goes up in one ``PutObject``, confirmed by the store's answer to it, without a second request. From two
    parts' worth up s3fs sends it in parts, and the ETag they make (the MD5 of the parts' MD5s) is computed while they
    are sent. GCS and Azure report an MD5 of some uploads only: it is asked for after.
    """
    if not hasattr(fs, "call_s3"):
        fs.put_file(str(local), remote, **_put_kwargs(fs))
        confirm_upload(fs, remote, local, store_checks_crc32)
    elif local.stat().st_size < 2 * PART_BYTES:  # (where s3fs too sends one PutObject, but from a copy in memory)
        _put_object(fs, local, remote, store_checks_crc32)
    else:
        with _md5_meanwhile(local, multipart=True) as etag:
            fs.put_file(str(local), remote, **_put_kwargs(fs))
            confirm_upload(fs, remote, local, store_checks_crc32, multipart_etag=etag)


def _put_object(fs: AbstractFileSystem, local: Path, remote: str, store_checks_crc32: bool) -> None:
    """One ``PutObject`` whose body is read from the staged file as it is sent (no copy of it in memory; a file of up
    to ``SMALL_BYTES`` is sent from memory, and by :func:`for_uploads`' client without a "100 Continue" round trip).

    A store that checks CRC32s gets the staged file's: it refuses the object unless what it received matches, and
    answers with the value. Any other store's answer carries its ETag, the MD5 of what it kept (unencrypted, one
    part), compared with the staged file's. A body cut short (s3fs retries a call with the file where the last try
    left it) fails either check and is tried again; an answer with neither value is asked again (HEAD).
    """
    bucket, _, key = remote.partition("/")
    body = local.read_bytes() if local.stat().st_size <= SMALL_BYTES else None  # a manifest, a run file: from memory
    checksum = {}
    if store_checks_crc32:  # of the bytes sent: the file's one read when they are in memory
        crc32 = _crc32_of(local) if body is None else _as_s3_crc32(zlib.crc32(body))
        checksum = {"ChecksumAlgorithm": "CRC32", "ChecksumCRC32": crc32}
    md5: Callable[[], str] | None = None  # the staged file's MD5, for a store whose ETag is the evidence
    if body is not None:
        answer = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body, **checksum)
        if not store_checks_crc32:
            digest = hashlib.md5(body, usedforsecurity=False).hexdigest()
            md5 = lambda: digest  # noqa: E731
    else:
        hashing = nullcontext(None) if store_checks_crc32 else _md5_meanwhile(local, multipart=False)
        with hashing as pending, open(local, "rb") as file_body:
            answer = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=file_body, **checksum)
        md5 = pending.result if pending is not None else None
    fs.invalidate_cache(remote)
    if store_checks_crc32 and answer.get("ChecksumCRC32") == checksum["ChecksumCRC32"]:
        return
    etag = str(answer.get("ETag") or "").strip('"')
    if md5 is not None and len(etag) == 32:  # an MD5 (an encrypted object's ETag is not: HEAD below)
        if etag != md5():
            raise StoreError(f"{redact(remote)}: the store's checksum {etag} is not the staged file's: not confirmed")
        return
    confirm_upload(fs, remote, local, store_checks_crc32)


def remove_objects(fs: AbstractFileSystem, paths: list[str]) -> None:
    """Delete ``paths`` (objects, not folders): on S3 in one ``DeleteObjects`` request, elsewhere one by one in order.
    Raise :class:`StoreError` naming the keys the store did not delete (missing ones count as deleted).

    An S3-compatible store without ``DeleteObjects`` (Google Cloud Storage's XML API until 2026, Riak CS) answers it
    with an error: the objects are then deleted one by one, in order, and only an error of those is raised."""
    if hasattr(fs, "call_s3") and _deleted_in_one_request(fs, paths):
        return
    for path in paths:
        fs.rm_file(path)


def _deleted_in_one_request(fs: AbstractFileSystem, paths: list[str]) -> bool:
    """S3's ``DeleteObjects`` of ``paths``; ``False`` when the store does not take that request."""
    buckets = {path.partition("/")[0] for path in paths}
    if len(buckets) != 1:
        raise ValueError(f"remove_objects takes the objects of one bucket, got {paths}")
    (bucket,) = buckets
    keys = [{"Key": path.partition("/")[2]} for path in paths]
    try:
        answer = fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    except OSError as err:  # (s3fs: NotImplemented or MethodNotAllowed; no bucket or no right fails again one by one)
        log.debug("the store %s did not take DeleteObjects (%s): deleting one by one", redact(bucket), err)
        return False
    for path in paths:
        fs.invalidate_cache(path)
    if answer.get("Errors"):
        failed = ", ".join(f"{e.get('Key')} ({e.get('Code')})" for e in answer["Errors"])
        raise StoreError(f"the store {redact(bucket)} did not delete {failed}")
    return True


def download(fs: AbstractFileSystem, remote: str, local: Path, size: int | None = None) -> None:
    """Get ``remote`` into ``local`` (through a temporary name: a cut-off download never sits under the real one)."""
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.download")
    try:
        fs.get_file(remote, str(tmp))
        if size is not None and tmp.stat().st_size != size:
            raise StoreError(f"{redact(remote)}: downloaded {tmp.stat().st_size} bytes, the manifest says {size}")
        tmp.replace(local)
    finally:
        tmp.unlink(missing_ok=True)


def download_tree(fs: AbstractFileSystem, root: str, local: Path, keep: Callable[[str], bool]) -> list[Path]:
    """Get every object under ``root`` whose path relative to it passes ``keep`` into ``local`` (same layout);
    returns the local paths. A name that would leave ``local`` (``..``, absolute) is never written."""
    fs.invalidate_cache(root)
    got = []
    for key in _files_under(fs, root):
        rel = key[len(root) :].strip("/")
        if not rel or not keep(rel) or ".." in Path(rel).parts:
            continue
        download(fs, key, local / rel)
        got.append(local / rel)
    return got


def _files_under(fs: AbstractFileSystem, root: str) -> list[str]:
    """Every object under ``root``; on S3 in one listing request. s3fs's ``find`` asks twice more (a HEAD and another
    listing) when nothing is under a key, to tell a missing folder from a file, and a new run's fit start waits on
    that: three round trips where one does."""
    parent, _, name = root.rstrip("/").rpartition("/")
    if hasattr(fs, "call_s3") and parent:
        return fs.find(parent, prefix=f"{name}/")
    return fs.find(root)


def abort_stale_uploads(fs: AbstractFileSystem, prefix: str) -> int:
    """Abort the multipart uploads under ``prefix`` that a killed process left (S3 only: other stores keep no parts
    outside an object). Returns how many were aborted. Call before this run starts uploading there."""
    if not hasattr(fs, "call_s3"):
        return 0
    bucket, _, key = prefix.partition("/")
    listing = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    aborted = 0
    for upload_ in listing.get("Uploads", []):
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload_["Key"], UploadId=upload_["UploadId"])
        aborted += 1
    if aborted:
        log.info("aborted %d unfinished multipart upload(s) under %s left by a killed process", aborted, redact(prefix))
    return aborted
