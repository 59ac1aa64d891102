"""The storage layer's transfers, Trainer-free: an upload counts only once the store reports it with the staged
file's size and checksum, a store that keeps other bytes is caught, retries log an outage once, downloads never
leave a torn file under the real name, and multipart uploads a killed process left are aborted. Against moto's S3
server on 127.0.0.1 where a store answers, and small fakes for what each backend reports."""

from __future__ import annotations

import base64
import hashlib
import logging
from types import SimpleNamespace

import fsspec
import pytest

from lightning_accel.storage import transfer
from lightning_accel.storage.transfer import (
    Backoff,
    OutageLog,
    StoreError,
    abort_stale_uploads,
    confirm_upload,
    download,
    download_tree,
    retrying,
    upload,
)


@pytest.fixture
def s3(bucket):
    return fsspec.filesystem("s3"), bucket


class Corrupting:
    """An S3 file system whose store keeps other bytes than were staged (a flipped byte, or the body cut short)."""

    def __init__(self, fs, damage) -> None:
        self.fs, self.damage = fs, damage

    def call_s3(self, method, **kwargs):
        if method == "put_object":
            kwargs = {**kwargs, "Body": self.damage(kwargs["Body"])}
        return self.fs.call_s3(method, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def test_an_upload_is_confirmed_and_a_store_that_keeps_other_bytes_is_caught(s3, tmp_path):
    fs, bucket = s3
    staged = tmp_path / "step=00000004.ckpt"
    staged.write_bytes(bytes(range(256)) * 400)
    upload(fs, staged, f"{bucket}/run/{staged.name}")
    assert fs.cat_file(f"{bucket}/run/{staged.name}") == staged.read_bytes()
    flipped = lambda body: body[:10] + bytes([body[10] ^ 1]) + body[11:]  # noqa: E731
    with pytest.raises(StoreError, match=r"the store's (CRC32|checksum) \S+ is not the staged file's: not confirmed"):
        upload(Corrupting(fs, flipped), staged, f"{bucket}/run/flipped.ckpt")
    with pytest.raises(StoreError, match=r"holds 102390 bytes, the staged file 102400: not confirmed"):
        upload(Corrupting(fs, lambda body: body[:-10]), staged, f"{bucket}/run/cut.ckpt")


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
    monkeypatch.setattr(transfer.time, "sleep", lambda s: None)
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


def test_downloads_never_leave_a_torn_file_and_stay_inside_their_folder(s3, tmp_path):
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
