"""The storage layer's transfers, Trainer-free: an upload counts only once the store reports it with the staged
file's size and checksum, a store that keeps other bytes is caught (one that checks CRC32s by its own check, one that
does not by its ETag), retries log an outage once, downloads never leave a torn file under the real name, and
multipart uploads a killed process left are aborted. Against moto's S3 server on 127.0.0.1 where a store answers
(it does not check CRC32s), and small fakes for what each backend reports and for a store that checks."""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import threading
import time
import zlib
from types import SimpleNamespace

import fsspec
import pytest

from lightning_accel.storage import retries, transfer
from lightning_accel.storage.retries import Backoff, OutageLog, StoreError, retrying
from lightning_accel.storage.transfer import (
    abort_stale_uploads,
    confirm_upload,
    download,
    download_tree,
    for_uploads,
    remove_objects,
    store_checks_crc32,
    upload,
)


@pytest.fixture
def s3(bucket):
    return fsspec.filesystem("s3"), bucket


class Corrupting:
    """An S3 file system whose store receives other bytes than were staged (a flipped byte, the body cut short)."""

    def __init__(self, fs, damage) -> None:
        self.fs, self.damage = fs, damage

    def call_s3(self, method, **kwargs):
        if method == "put_object":
            body = kwargs["Body"] if isinstance(kwargs["Body"], bytes) else kwargs["Body"].read()
            kwargs = {**kwargs, "Body": self.damage(body)}
        return self.fs.call_s3(method, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def flip_a_byte(body: bytes) -> bytes:
    return body[:10] + bytes([body[10] ^ 1]) + body[11:]


class Checking(Corrupting):
    """A store that checks the CRC32 sent with an object against the body it received, as S3 does (moto does not)."""

    def __init__(self, fs) -> None:
        super().__init__(fs, damage=lambda body: body)

    def call_s3(self, method, **kwargs):
        if method == "put_object" and "ChecksumCRC32" in kwargs:
            body = kwargs["Body"] if isinstance(kwargs["Body"], bytes) else kwargs["Body"].read()
            if base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode() != kwargs["ChecksumCRC32"]:
                raise OSError("BadDigest: The CRC32 you specified did not match the calculated checksum.")
            kwargs = {**kwargs, "Body": body}
        return self.fs.call_s3(method, **kwargs)


class RefusingChecksums(Corrupting):
    """A store that refuses any upload sent with a checksum header, right or wrong: it checks nothing."""

    def __init__(self, fs) -> None:
        super().__init__(fs, damage=lambda body: body)

    def call_s3(self, method, **kwargs):
        if method == "put_object" and "ChecksumCRC32" in kwargs:
            raise OSError("InvalidArgument: x-amz-checksum-crc32 is not supported")
        return self.fs.call_s3(method, **kwargs)


class RetriedWhereItStopped(Corrupting):
    """s3fs retrying a ``PutObject`` whose first try read part of the file: the same file object, where it stopped."""

    def call_s3(self, method, **kwargs):
        if method == "put_object":
            kwargs["Body"].read(100)  # (a file's body: one sent from memory is sent whole on each try)
        return self.fs.call_s3(method, **kwargs)


class BodyKinds(Corrupting):
    """Records what each ``PutObject``'s body was: bytes, or the open file."""

    def __init__(self, fs) -> None:
        super().__init__(fs, damage=lambda body: body)
        self.kinds: list[str] = []

    def call_s3(self, method, **kwargs):
        if method == "put_object":
            self.kinds.append("bytes" if isinstance(kwargs["Body"], bytes) else "file")
        return self.fs.call_s3(method, **kwargs)


def test_an_upload_is_confirmed_and_a_store_that_keeps_other_bytes_is_caught(s3, tmp_path):
    """moto keeps what it is sent without checking the CRC32 that came with it: its ETag (the MD5 of what it kept)
    confirms an upload. A store that checks CRC32s is sent the staged file's and refuses other bytes itself."""
    fs, bucket = s3
    staged = tmp_path / "step=00000004.ckpt"
    # a manifest's size goes up from memory (no "100 Continue" round trip); a checkpoint's is read as it is sent
    for repeats, body in ((400, "bytes"), (6000, "file")):
        staged.write_bytes(bytes(range(256)) * repeats)
        assert (staged.stat().st_size <= transfer.SMALL_BYTES) is (body == "bytes")
        for checks, store in ((False, fs), (True, Checking(fs))):
            kinds = BodyKinds(store)
            upload(kinds, staged, f"{bucket}/run/{staged.name}", store_checks_crc32=checks)
            assert kinds.kinds == [body]
            assert fs.cat_file(f"{bucket}/run/{staged.name}") == staged.read_bytes()
            refused = r"BadDigest" if checks else r"the store's checksum [0-9a-f]{32} is not the staged file's"
            damages = [Corrupting(store, flip_a_byte), Corrupting(store, lambda body: body[:-10])]
            if body == "file":
                damages.append(RetriedWhereItStopped(store, damage=None))
            for damaged in damages:
                with pytest.raises(OSError, match=refused):
                    upload(damaged, staged, f"{bucket}/run/damaged.ckpt", store_checks_crc32=checks)


def test_small_bodies_go_up_without_asking_for_100_continue_and_checkpoints_still_ask(s3, tmp_path):
    """botocore asks the store for "100 Continue" before every PutObject body, bytes too (it wraps them in a file):
    a round trip before the body leaves. The uploads' client sends a body of up to SMALL_BYTES (a manifest, a run file)
    at once; a larger one still asks, so that a store can refuse a checkpoint before it is sent."""
    fs, bucket = s3
    uploads = for_uploads(fs)
    asked: list[tuple[str, bytes | None]] = []
    clients = ((uploads.s3, "ours"), (fs.s3, "botocore's"))  # (fsspec keeps both for the session's later tests)
    for client, name in clients:
        client.meta.events.register(
            "before-send.s3.PutObject",
            lambda request, name=name, **_: asked.append((name, request.headers.get("Expect"))),
            unique_id=f"test-records-{name}",
        )
    try:
        staged = tmp_path / "run-file.json"
        for size in (1000, transfer.SMALL_BYTES, transfer.SMALL_BYTES + 1):
            staged.write_bytes(b"x" * size)
            upload(uploads, staged, f"{bucket}/run/{size}")
            assert fs.cat_file(f"{bucket}/run/{size}") == staged.read_bytes()
        fs.pipe_file(f"{bucket}/run/plain", b"x" * 1000)
    finally:
        for client, name in clients:
            client.meta.events.unregister("before-send.s3.PutObject", unique_id=f"test-records-{name}")
    assert [(name, expect and bytes(expect).decode()) for name, expect in asked] == [
        ("ours", None), ("ours", None), ("ours", "100-continue"), ("botocore's", "100-continue")
    ]  # fmt: skip
    assert for_uploads(fs).s3.meta.events is uploads.s3.meta.events  # (fsspec's cache: one client, one handler)


def test_uploads_send_no_checksum_of_botocores_own_and_are_still_confirmed(s3, tmp_path):
    """botocore sends a CRC32 of its own with every upload by default (a pass over the file); the file system our
    uploads go through leaves it out, and its uploads are confirmed and refused exactly as before."""
    fs, bucket = s3
    uploads = for_uploads(fs)
    for store, sends_its_own in ((fs, True), (uploads, False)):
        store.call_s3("put_object", Bucket=bucket, Key="plain", Body=b"abc")
        head = fs.call_s3("head_object", Bucket=bucket, Key="plain", ChecksumMode="ENABLED")
        assert ("ChecksumCRC32" in head) is sends_its_own
    staged = tmp_path / "step=00000004.ckpt"
    staged.write_bytes(bytes(range(256)) * 400)
    upload(uploads, staged, f"{bucket}/run/{staged.name}")
    assert fs.cat_file(f"{bucket}/run/{staged.name}") == staged.read_bytes()  # the same store and credentials
    with pytest.raises(StoreError, match=r"the store's checksum [0-9a-f]{32} is not the staged file's"):
        upload(Corrupting(uploads, flip_a_byte), staged, f"{bucket}/run/damaged.ckpt")
    memory = fsspec.filesystem("memory")
    assert for_uploads(memory) is memory


def test_a_checkpoint_and_its_manifest_are_deleted_in_one_request(s3, tmp_path):
    fs, bucket = s3
    names = [f"{bucket}/run/step=00000004.ckpt.manifest.json", f"{bucket}/run/step=00000004.ckpt"]
    for name in names:
        fs.pipe_file(name, b"x")
    sent = []
    counting = SimpleNamespace(
        call_s3=lambda method, **kw: sent.append(method) or fs.call_s3(method, **kw),
        invalidate_cache=fs.invalidate_cache,
    )
    remove_objects(counting, [*names, f"{bucket}/run/already-gone"])  # a missing object counts as deleted
    assert sent == ["delete_objects"] and not any(fs.exists(name) for name in names)
    refusing = SimpleNamespace(
        call_s3=lambda method, **kw: {"Errors": [{"Key": "run/step=00000004.ckpt", "Code": "AccessDenied"}]},
        invalidate_cache=lambda path: None,
    )
    with pytest.raises(StoreError, match=r"did not delete run/step=00000004.ckpt \(AccessDenied\)"):
        remove_objects(refusing, names)
    with pytest.raises(ValueError, match="the objects of one bucket"):
        remove_objects(fs, [f"{bucket}/a", "another-bucket/b"])
    memory = fsspec.filesystem("memory")  # elsewhere: one by one
    for name in ("/run/a.manifest.json", "/run/a"):
        memory.pipe_file(name, b"x")
    remove_objects(memory, ["/run/a.manifest.json", "/run/a"])
    assert not memory.exists("/run/a") and not memory.exists("/run/a.manifest.json")


def test_a_store_is_asked_whether_it_checks_the_crc32_it_is_sent(s3, tmp_path):
    fs, bucket = s3
    assert zlib.crc32(transfer.CRC_PROBE_BODY) != 0  # the probe's CRC32 is not the wrong one it is sent with
    assert store_checks_crc32(fs, f"{bucket}/probe") is False  # moto keeps the object (then deleted again)
    assert not fs.exists(f"{bucket}/probe")
    assert store_checks_crc32(Checking(fs), f"{bucket}/probe") is True
    assert not fs.exists(f"{bucket}/probe")
    assert store_checks_crc32(RefusingChecksums(fs), f"{bucket}/probe") is False  # refuses every CRC32 header
    assert not fs.exists(f"{bucket}/probe")
    with pytest.raises(FileNotFoundError):  # the probe proves the store takes writes: its errors are raised
        store_checks_crc32(fs, "no-such-bucket-here/probe")
    assert store_checks_crc32(SimpleNamespace(), "bucket/probe") is False  # not S3
    # the CRC32 a HEAD reports counts only where the store checks the ones it is sent
    staged = tmp_path / "staged"
    staged.write_bytes(b"checkpoint bytes" * 1000)
    crc = base64.b64encode(zlib.crc32(staged.read_bytes()).to_bytes(4, "big")).decode()
    head = {"ContentLength": 16000, "ETag": '"' + "0" * 32 + '"', "ChecksumCRC32": crc}
    fake = SimpleNamespace(invalidate_cache=lambda path: None, call_s3=lambda method, **kwargs: head)
    confirm_upload(fake, "bucket/staged", staged, store_checks_crc32=True)
    with pytest.raises(StoreError, match=r"the store's checksum 0{32} is not the staged file's"):
        confirm_upload(fake, "bucket/staged", staged, store_checks_crc32=False)


def test_each_backends_own_report_confirms_or_refuses_an_upload(tmp_path):
    """What Azure (Content-MD5), GCS (base64 md5Hash), S3 (an MD5 ETag, a multipart one, an encrypted object's) and
    a store with no checksum report, against the staged file."""
    staged = tmp_path / "staged"
    staged.write_bytes(b"checkpoint bytes" * 1000)
    md5 = hashlib.md5(staged.read_bytes()).digest()

    def confirmed(info) -> bool:
        fake = SimpleNamespace(invalidate_cache=lambda path: None, info=lambda path: {"size": 16000, **info})
        try:
            confirm_upload(fake, "bucket/staged", staged)
        except StoreError:
            return False
        return True

    assert confirmed({"content_settings": {"content_md5": bytearray(md5)}})
    assert not confirmed({"content_settings": {"content_md5": bytearray(hashlib.md5(b"other").digest())}})
    assert confirmed({"md5Hash": base64.b64encode(md5).decode()})
    assert not confirmed({"md5Hash": base64.b64encode(hashlib.md5(b"other").digest()).decode()})
    assert confirmed({"ETag": f'"{md5.hex()}"'}) and not confirmed({"ETag": '"' + "0" * 32 + '"'})
    part = hashlib.md5(hashlib.md5(staged.read_bytes()).digest()).hexdigest()
    assert confirmed({"ETag": f'"{part}-1"'}) and not confirmed({"ETag": '"' + "0" * 32 + '-1"'})
    assert confirmed({"ETag": '"a1b2c3d4e5f6"'})  # not an MD5 (an encrypted object's): the size confirms it
    assert confirmed({}) and not confirmed({"size": 15999})


def test_retries_back_off_log_an_outage_once_and_give_up_at_the_deadline(caplog, monkeypatch):
    monkeypatch.setattr(retries.time, "sleep", lambda s: None)
    failures = iter([ConnectionError("refused")] * 3)

    def flaky():
        err = next(failures, None)
        if err is not None:
            raise err
        return "done"

    outage = OutageLog("s3://user:secret@bucket/run")
    with caplog.at_level(logging.WARNING, logger="lightning_accel"):
        assert retrying(flaky, outage, "uploading step=4") == "done"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "did not answer while uploading step=4 (ConnectionError: refused)" in said[0]
    assert "answers again after" in said[1] and "(3 failed tries)" in said[1]
    assert "secret" not in " ".join(said)  # credentials in a URL are never logged
    with pytest.raises(StoreError, match="writing a probe on s3://bucket/run failed: PermissionError: denied"):
        retrying(lambda: (_ for _ in ()).throw(PermissionError("denied")), outage, "writing a probe", final=(OSError,))
    with pytest.raises(TypeError):  # a bug of ours is raised at once, never retried as an outage
        retrying(lambda: (_ for _ in ()).throw(TypeError("bug")), outage, "uploading")
    backoff = Backoff(first_s=0.5, cap_s=2.0)
    delays = [backoff.delay() for _ in range(5)]
    assert all(0.4 <= d <= 0.5 for d in delays[:1]) and all(1.6 <= d <= 2.0 for d in delays[2:])


class Recording(Corrupting):
    """Records the S3 calls made; with ``meet``, each ``PutObject`` waits at a barrier for another one (so two of
    them pass only if they are in flight at once)."""

    def __init__(self, fs, meet: threading.Barrier | None = None) -> None:
        super().__init__(fs, damage=lambda body: body)
        self.calls: list[str] = []
        self.meet = meet

    def call_s3(self, method, **kwargs):
        self.calls.append(method)
        if method == "put_object" and self.meet is not None:
            self.meet.wait()
        return self.fs.call_s3(method, **kwargs)


class HalfAnswering(Recording):
    """A store whose answer to the upload with the right CRC32 is lost (the other one is taken)."""

    def call_s3(self, method, **kwargs):
        if method == "put_object" and kwargs["Key"].endswith("-right-crc32"):
            self.calls.append(method)
            raise ConnectionError("no answer")
        return super().call_s3(method, **kwargs)


class WithoutMultiDelete(Recording):
    """An S3-compatible store without ``DeleteObjects`` (Google Cloud Storage's XML API until 2026), answering it as
    s3fs translates the store's error: ``error``."""

    def __init__(self, fs, error: OSError) -> None:
        super().__init__(fs)
        self.error = error

    def call_s3(self, method, **kwargs):
        if method == "delete_objects":
            self.calls.append(method)
            raise self.error
        return super().call_s3(method, **kwargs)


def test_the_fit_start_probe_is_two_round_trips_and_leaves_nothing(s3):
    """Both CRC32 probes are in flight at once (a barrier that two sequential PUTs would break), then one delete."""
    fs, bucket = s3
    for store in (fs, Checking(fs)):
        recording = Recording(store, meet=threading.Barrier(2, timeout=10))
        store_checks_crc32(recording, f"{bucket}/probe")
        assert recording.calls == ["put_object", "put_object", "delete_objects"]
        assert fs.find(bucket) == []
    recording = Recording(fs)  # no bucket: nothing was written, so no delete waits on the store before the error
    with pytest.raises(FileNotFoundError):
        store_checks_crc32(recording, "no-such-bucket-here/probe")
    assert recording.calls == ["put_object", "put_object"]
    one_fails = HalfAnswering(fs)  # one upload taken, the other cut off: that error, and the one taken is deleted
    with pytest.raises(ConnectionError, match="no answer"):
        store_checks_crc32(one_fails, f"{bucket}/probe")
    assert sorted(one_fails.calls) == ["delete_objects", "put_object", "put_object"] and fs.find(bucket) == []


def test_a_store_without_delete_objects_gets_its_objects_deleted_one_by_one(s3):
    fs, bucket = s3
    for error in (OSError(errno.ENOSYS, "NotImplemented"), OSError(errno.EPERM, "MethodNotAllowed")):
        store = WithoutMultiDelete(fs, error)
        names = [f"{bucket}/run/step=00000004.ckpt.manifest.json", f"{bucket}/run/step=00000004.ckpt"]
        for name in names:
            fs.pipe_file(name, b"x")
        remove_objects(store, names)
        assert store.calls == ["delete_objects"] and not any(fs.exists(name) for name in names)
        assert store_checks_crc32(store, f"{bucket}/probe") is False  # the fit-start probe too: nothing left
        assert fs.find(bucket) == []
    with pytest.raises(FileNotFoundError):  # no bucket: the one-by-one delete's own error
        remove_objects(WithoutMultiDelete(fs, OSError(errno.EIO, "?")), ["no-such-bucket-here/a"])


def test_downloads_never_leave_a_torn_file_and_stay_inside_their_folder(s3, tmp_path, monkeypatch):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/run/a.ckpt", b"x" * 100)
    fs.pipe_file(f"{bucket}/run/profile/trace.json", b"{}")
    with pytest.raises(StoreError, match="downloaded 100 bytes, the manifest says 120"):
        download(fs, f"{bucket}/run/a.ckpt", tmp_path / "a.ckpt", size=120)
    assert list(tmp_path.iterdir()) == []  # neither the real name nor the temporary one
    got = download_tree(fs, f"{bucket}/run", tmp_path / "copy", keep=lambda rel: not rel.endswith(".ckpt"))
    assert (
        got == [tmp_path / "copy/profile/trace.json"] and (tmp_path / "copy/profile/trace.json").read_bytes() == b"{}"
    )
    fs.pipe_file(f"{bucket}/run2/beside.json", b"{}")  # a folder whose name starts the same is not under run/
    assert download_tree(fs, f"{bucket}/run", tmp_path / "again", keep=lambda rel: True) == [
        tmp_path / "again/a.ckpt",
        tmp_path / "again/profile/trace.json",
    ]
    calls, call_s3 = [], type(fs)._call_s3

    async def recording(self, method, *args, **kwargs):
        calls.append(method)
        return await call_s3(self, method, *args, **kwargs)

    monkeypatch.setattr(type(fs), "_call_s3", recording)  # s3fs's own requests (find makes them inside s3fs)
    # a new run's empty folder: one listing (s3fs's find asks three times: a HEAD and a listing more)
    assert download_tree(fs, f"{bucket}/new-run", tmp_path / "none", keep=lambda rel: True) == []
    assert calls == ["list_objects_v2"]


def test_multipart_uploads_left_by_a_killed_process_are_aborted(s3):
    fs, bucket = s3
    started = fs.call_s3("create_multipart_upload", Bucket=bucket, Key="run/step=00000008.ckpt")
    fs.call_s3(
        "upload_part",
        Bucket=bucket,
        Key="run/step=00000008.ckpt",
        UploadId=started["UploadId"],
        PartNumber=1,
        Body=b"x",
    )
    assert abort_stale_uploads(fs, f"{bucket}/run") == 1
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
    assert abort_stale_uploads(fs, f"{bucket}/run") == 0
    assert abort_stale_uploads(fsspec.filesystem("memory"), "anything") == 0  # stores that keep no parts


class PutFile:
    """s3fs's ``put_file`` (a checkpoint over ``PART_BYTES``) meeting the hashing thread at ``barrier`` before it sends,
    and sending ``damage`` of the file instead of the file where given."""

    def __init__(self, fs, barrier: threading.Barrier, damage=None) -> None:
        self.fs, self.barrier, self.damage = fs, barrier, damage

    def put_file(self, lpath, rpath, **kwargs):
        self.barrier.wait()
        if self.damage is not None:
            sent = f"{lpath}.sent"
            with open(lpath, "rb") as f, open(sent, "wb") as out:
                out.write(self.damage(f.read()))
            lpath = sent
        return self.fs.put_file(lpath, rpath, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def test_a_checkpoint_sent_in_parts_is_confirmed_by_an_etag_computed_while_it_is_sent(s3, tmp_path, monkeypatch):
    """Below two parts' worth a checkpoint goes up in one ``PutObject`` streamed from the file (s3fs would read it
    into memory first); from there in parts through s3fs, its ETag the MD5 of the parts' MD5s. That ETag is computed
    while the parts are sent: the send and the hash meet at a barrier, which a hash after the send never reaches. A
    store that keeps other bytes is still caught."""
    fs, bucket = s3
    monkeypatch.setattr(transfer, "PART_BYTES", 5 * 2**20)  # S3's smallest part
    staged = tmp_path / "step=00000004.ckpt"
    staged.write_bytes(bytes(range(256)) * (9 * 2**20 // 256))
    kinds = BodyKinds(fs)
    upload(kinds, staged, f"{bucket}/run/one-put.ckpt", store_checks_crc32=True)
    assert kinds.kinds == ["file"] and fs.cat_file(f"{bucket}/run/one-put.ckpt") == staged.read_bytes()

    staged.write_bytes(bytes(range(256)) * (11 * 2**20 // 256))
    real_md5_of = transfer._md5_of
    for checks, damage in ((False, None), (True, None), (False, flip_a_byte), (True, lambda body: body[:-10])):
        barrier = threading.Barrier(2, timeout=20)

        def md5_of(path, multipart, stop=None, barrier=barrier):
            barrier.wait()
            return real_md5_of(path, multipart, stop)

        monkeypatch.setattr(transfer, "_md5_of", md5_of)
        remote = f"{bucket}/run/{'damaged' if damage else 'parts'}.ckpt"
        if damage is not None:
            with pytest.raises(StoreError, match=r"(checksum [0-9a-f]{32}-3 is not|holds 11534326 bytes)"):
                upload(PutFile(fs, barrier, damage), staged, remote, store_checks_crc32=checks)
            continue
        upload(PutFile(fs, barrier), staged, remote, store_checks_crc32=checks)
        assert fs.cat_file(remote) == staged.read_bytes()
        assert fs.info(remote, refresh=True)["ETag"].strip('"').endswith("-3")


@pytest.mark.parametrize("fails", ["send", "confirmation"])
def test_a_send_that_fails_does_not_wait_for_the_hash_that_went_with_it(tmp_path, monkeypatch, fails):
    """The error of the send (or of the store's report after it) is raised at once, and the hashing thread, a daemon
    that never holds the process past its exit, stops at its next part instead of reading the rest of the file (here
    it waits for the stop; a hash that was never stopped would go on to the end)."""
    monkeypatch.setattr(transfer, "PART_BYTES", 2**20)
    staged = tmp_path / "step=00000004.ckpt"
    staged.write_bytes(b"\0" * 3 * 2**20)
    real_md5_of, hashed, daemons = transfer._md5_of, [], []

    def md5_of(path, multipart, stop=None):
        daemons.append(threading.current_thread().daemon)
        stop.wait(10)
        hashed.append(real_md5_of(path, multipart, stop))

    def refused(*args, **kwargs):
        raise OSError("AccessDenied")

    monkeypatch.setattr(transfer, "_md5_of", md5_of)
    store = SimpleNamespace(invalidate_cache=lambda path: None, call_s3=refused, put_file=lambda *a, **k: None)
    if fails == "send":
        store.put_file = refused
    started = time.monotonic()
    with pytest.raises(OSError, match="AccessDenied"):
        upload(store, staged, "bucket/run/step=00000004.ckpt")
    assert time.monotonic() - started < 5
    for thread in threading.enumerate():
        if thread.name.startswith("accel-md5"):
            thread.join(timeout=20)
    assert hashed == [""] and daemons == [True]
