"""What keeps a checkpoint cheap without giving up its guarantees: reused staging buffers, a streaming xxh3
checksum, no second read of files this process wrote, deletions off the training thread."""

from __future__ import annotations

import hashlib
import json
import threading

import torch
from lightning.pytorch import Trainer

from lightning_accel.checkpoint import (
    AsyncAtomicCheckpointIO,
    AtomicCheckpointIO,
    PreemptionCheckpoint,
    atomic,
    find_resume_checkpoint,
    retention,
    verify,
)
from lightning_accel.checkpoint.async_io import StagingBuffers
from lightning_accel.checkpoint.atomic import atomic_save
from lightning_accel.checkpoint.durable import manifest_path
from lightning_accel.demos import MLPClassifier, SyntheticClassificationDataModule
from tests.conftest import requires_cuda, tiny_trainer_kwargs


def test_staging_reuses_its_buffers_and_is_a_point_in_time_copy():
    weight, momentum = torch.randn(64, 64), torch.randn(64, 64)
    checkpoint = {"state_dict": {"w": weight}, "optimizer_states": [{"state": {0: {"momentum_buffer": momentum}}}]}
    staging = StagingBuffers()
    first, ready = staging.stage(checkpoint)
    assert ready is None  # CPU tensors: nothing queued on a device
    staged_w = first["state_dict"]["w"]
    assert staged_w.data_ptr() != weight.data_ptr() and torch.equal(staged_w, weight)
    weight.add_(1.0)  # training goes on: the staged copy keeps the value at the save
    assert not torch.equal(staged_w, weight)
    second, _ = staging.stage(checkpoint)
    # the same host memory again (no new pages), now holding the new value
    assert second["state_dict"]["w"].data_ptr() == staged_w.data_ptr()
    assert torch.equal(second["state_dict"]["w"], weight)
    assert second["optimizer_states"][0]["state"][0]["momentum_buffer"].data_ptr() == (
        first["optimizer_states"][0]["state"][0]["momentum_buffer"].data_ptr()
    )
    # a layout change (a larger layer) gets a buffer of its own shape
    checkpoint["state_dict"]["w"] = torch.randn(32, 128)
    third, _ = staging.stage(checkpoint)
    assert third["state_dict"]["w"].shape == (32, 128) and torch.equal(
        third["state_dict"]["w"], checkpoint["state_dict"]["w"]
    )
    # non-tensor values pass through untouched; views are saved as themselves, not their whole storage
    view = torch.arange(100.0)[10:20]
    staged_view = staging.stage({"v": view, "n": 3})[0]
    assert (
        staged_view["n"] == 3
        and torch.equal(staged_view["v"], view)
        and staged_view["v"].untyped_storage().size() == 40
    )


def test_manifest_carries_an_xxh3_checksum_and_old_sha256_manifests_still_verify(tmp_path):
    path = tmp_path / "step=1.ckpt"
    manifest = atomic_save({"w": torch.ones(1000)}, path, {"global_step": 1})
    assert manifest["format"] == 2 and len(manifest["xxh3_64"]) == 16 and "sha256" not in manifest
    assert verify(path).checked_by == "xxh3_64"
    # a checkpoint written by an earlier version: format 1, SHA-256
    old = {k: v for k, v in manifest.items() if k != "xxh3_64"}
    old.update(format=1, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    manifest_path(path).write_text(json.dumps(old))
    assert verify(path) and verify(path).checked_by == "sha256"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "SHA-256 does not match" in verify(path).reason


def fit_with_checkpoints(tmp_path, async_save: bool, steps: int = 12) -> PreemptionCheckpoint:
    cb = PreemptionCheckpoint(tmp_path / "ck", every_n_steps=2, keep_last=2, async_save=async_save)
    dm = SyntheticClassificationDataModule(num_samples=512, input_dim=8, batch_size=16)
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=steps, callbacks=[cb])).fit(
        MLPClassifier(input_dim=8), datamodule=dm
    )
    return cb


def test_pruning_trusts_what_this_process_wrote_and_rechecks_anything_changed(tmp_path, monkeypatch):
    reads: list[str] = []
    real_verify = retention.verify
    monkeypatch.setattr(
        retention, "verify", lambda path, *a, **k: reads.append(path.name) or real_verify(path, *a, **k)
    )
    for async_save in (False, True):
        reads.clear()
        cb = fit_with_checkpoints(tmp_path / str(async_save), async_save)
        assert len(cb.saved) == 6
        assert sorted(p.name for p in (tmp_path / str(async_save) / "ck").glob("*.ckpt")) == [
            "step=00000010.ckpt",
            "step=00000012.ckpt",
        ]
        assert reads == []  # six saves, four deletions, and not one file read back
    # a file changed after it was written (even to the same size) is read and checked before anything is deleted
    io = AtomicCheckpointIO()
    folder = tmp_path / "changed"
    cb = PreemptionCheckpoint(folder, keep_last=1)
    cb.run_id = "r"
    for step in (1, 2):
        io.save_checkpoint(
            {"global_step": step, "lightning_accel_run_id": "r", "w": torch.ones(64)}, folder / f"step={step:08d}.ckpt"
        )
    newest = folder / "step=00000002.ckpt"
    assert io.wrote(newest)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert not io.wrote(newest)
    cb._prune(io)
    assert reads == ["step=00000002.ckpt"]  # only the altered one is read; it fails, so step 1 is kept
    assert (folder / "step=00000001.ckpt").exists()


def test_async_deletions_run_behind_the_write_off_the_training_thread(tmp_path, monkeypatch):
    threads: list[str] = []
    remove = AtomicCheckpointIO.remove_checkpoint

    def recording(self, path):
        threads.append(threading.current_thread().name)
        remove(self, path)

    monkeypatch.setattr(AtomicCheckpointIO, "remove_checkpoint", recording)
    # Each background write starts once the prune after its save has run, so every save's own write is still in
    # flight when that prune looks (as with any checkpoint larger than this test's): without this, a loaded
    # machine may finish the last write before its prune, and that deletion moves into the write thread.
    pruned = threading.Event()
    prune, write = PreemptionCheckpoint._prune, AtomicCheckpointIO.save_checkpoint

    def prune_then_release(self, io=None):
        prune(self, io)
        pruned.set()

    def write_after_prune(self, checkpoint, path, storage_options=None):
        if threading.current_thread().name.startswith("accel-ckpt"):
            assert pruned.wait(30)
            pruned.clear()
        write(self, checkpoint, path, storage_options)

    monkeypatch.setattr(PreemptionCheckpoint, "_prune", prune_then_release)
    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", write_after_prune)
    cb = fit_with_checkpoints(tmp_path, async_save=True)
    # saves at 8, 10, 12 each delete the oldest complete file in the write thread; teardown's prune (after
    # the thread is gone) deletes the one that was still in flight at the last save
    assert len(threads) == 4 and all(name.startswith("accel-ckpt") for name in threads[:3])
    assert threads[3] == threading.main_thread().name
    assert sorted(p.name for p in cb.dirpath.glob("*.ckpt")) == ["step=00000010.ckpt", "step=00000012.ckpt"]
    assert all(verify(p) for p in cb.dirpath.glob("*.ckpt"))
    assert len(list(cb.dirpath.glob("*.manifest.json"))) == 2  # each manifest went with its file
    assert not list(cb.dirpath.glob(".spare*"))  # the file kept for recycling went at teardown


def test_a_failed_background_deletion_is_raised_like_a_failed_write(tmp_path, monkeypatch):
    io = AsyncAtomicCheckpointIO(recycle=False)
    io.save_checkpoint({"w": torch.ones(8)}, tmp_path / "a.ckpt")

    def refuse(self, path):
        raise PermissionError(13, "denied")

    monkeypatch.setattr(atomic.TorchCheckpointIO, "remove_checkpoint", refuse)
    io.remove_checkpoint(tmp_path / "a.ckpt")
    try:
        io.wait()
    except PermissionError as err:
        assert "denied" in str(err)
    else:
        raise AssertionError("the deletion's error was lost")
    finally:
        io.teardown()


def test_a_removed_checkpoint_is_overwritten_in_place_by_the_next_save(tmp_path):
    io = AtomicCheckpointIO()
    big, small = tmp_path / "step=1.ckpt", tmp_path / "step=3.ckpt"
    io.save_checkpoint({"w": torch.randn(4096)}, big)
    io.save_checkpoint({"w": torch.randn(16)}, tmp_path / "step=2.ckpt")
    inode = big.stat().st_ino
    io.remove_checkpoint(big)
    assert not big.exists() and not manifest_path(big).exists()
    (spare,) = [p for p in tmp_path.iterdir() if p.name.startswith(".spare")]
    assert spare.stat().st_ino == inode and find_resume_checkpoint(tmp_path) == str(tmp_path / "step=2.ckpt")
    expected = torch.randn(100)
    io.save_checkpoint({"w": expected}, small)  # into the old file's blocks, cut to the new length
    assert small.stat().st_ino == inode and not spare.exists()
    assert verify(small) and torch.equal(torch.load(small)["w"], expected)
    assert small.stat().st_size == json.loads(manifest_path(small).read_text())["bytes"]
    io.remove_checkpoint(small)
    io.teardown()  # the spare goes with the IO; a removal after teardown deletes for good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt", "step=2.ckpt.manifest.json"]
    io.remove_checkpoint(tmp_path / "step=2.ckpt")
    assert list(tmp_path.iterdir()) == []


@requires_cuda
def test_cuda_tensors_stage_into_pinned_buffers_without_blocking_the_host():
    weight = torch.randn(1024, 1024, device="cuda")
    expected = weight.cpu()
    staged, ready = StagingBuffers().stage({"w": weight})
    assert ready is not None and staged["w"].device.type == "cpu" and staged["w"].is_pinned()
    weight.add_(1.0)  # queued after the copy on the same stream: the snapshot is still the value at the save
    ready.synchronize()
    assert torch.equal(staged["w"], expected)
