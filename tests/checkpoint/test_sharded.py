"""Sharded checkpoint folders (torch DCP under FSDP2): sealed with a manifest, found, pruned and resumed exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_accel.checkpoint import find_resume_checkpoint, list_checkpoints, verify
from lightning_accel.checkpoint.durable import manifest_path
from lightning_accel.checkpoint.sharded import seal_folder

ROOT = Path(__file__).resolve().parents[2]


def dcp_folder(parent: Path, step: int) -> Path:
    folder = parent / f"step={step:08d}.ckpt"
    dcp.save({"w": torch.full((1000,), float(step))}, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": step}, folder / "meta.pt")  # what Lightning's ModelParallelStrategy adds
    return folder


def test_a_sealed_folder_is_verified_file_by_file_and_found_for_resume(tmp_path):
    old, new = dcp_folder(tmp_path, 5), dcp_folder(tmp_path, 10)
    for folder, step in ((old, 5), (new, 10)):
        manifest = seal_folder(folder, {"global_step": step, "run_id": "r"})
        assert manifest["kind"] == "folder" and set(manifest["files"]) >= {".metadata", "meta.pt"}
        assert all("xxh3_64" in e for e in manifest["files"].values())  # all small here: all checksummed
    assert [p.name for p in list_checkpoints(tmp_path)] == [new.name, old.name]
    assert verify(new) and find_resume_checkpoint(tmp_path) == str(new)
    # a shard cut short, then an altered metadata file: each named, and resume falls back to the older folder
    shard = next(p for p in new.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-10])
    assert "truncated" in verify(new).reason and shard.name in verify(new).reason
    with pytest.warns(UserWarning, match="Skipping checkpoint .*step=00000010"):
        assert find_resume_checkpoint(tmp_path) == str(old)
    meta = old / "meta.pt"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0xFF
    meta.write_bytes(bytes(data))
    assert "meta.pt: xxh3-64 checksum does not match" in verify(old).reason
    assert verify(old, checksum=False)  # sizes only
    # unsealed folders: an unfinished one (no DCP .metadata) is refused, a finished DCP one is used with a reason
    unfinished = tmp_path / "step=00000020.ckpt"
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"x" * 100)
    assert not verify(unfinished) and "neither a manifest" in verify(unfinished).reason
    foreign = dcp_folder(tmp_path, 30)
    assert verify(foreign).checked_by == "dcp" and not manifest_path(foreign).exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_dcp_folders_in_a_bucket_resume_bitwise_on_two_ranks_and_resharded_from_two_to_one_to_two(
    tmp_path, bucket
):
    """accel_fsdp saving torch DCP folders to a bucket (moto's S3 server on 127.0.0.1): 10 steps, then the bucket's
    objects copied to a local folder resume there at step 10 (mid-epoch) to 20, bitwise equal to a 20-step run.
    From the bucket itself, one rank resumes the two-rank folder to step 15 (resharded), and two ranks resume that
    to step 20, within rtol 1e-4 of the 20-step run."""

    def launch(runs: dict[str, str], devices: int = 2) -> None:
        """Each run (NAME: its options) one after another in one launch on ``devices`` ranks, in tmp_path/NAME."""
        cmd = [sys.executable, str(ROOT / "tests/strategies/train_distributed.py"), "--out", str(tmp_path)]
        options = f"--strategy accel_fsdp_fp32 --devices {devices}"
        cmd += [arg for name, extra in runs.items() for arg in ("--run", f"{name}={options} {extra}")]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]

    url = f"s3://{bucket}/fsdp"
    fs = fsspec.filesystem("s3")
    launch({"full": "--max-steps 20", "first": f"--max-steps 10 --sharded-checkpoints {url}"})
    full = tmp_path / "full"
    manifest = json.loads(fs.cat_file(f"{bucket}/fsdp/step=00000010.ckpt.manifest.json"))
    assert manifest["global_step"] == 10 and manifest["kind"] == "folder"
    assert {".metadata", "meta.pt"} <= set(manifest["files"])  # DCP's index, Lightning's loop/callback state
    for rel, entry in manifest["files"].items():  # every file of the folder is in the store, with its size
        assert fs.info(f"{bucket}/fsdp/step=00000010.ckpt/{rel}")["size"] == entry["bytes"], rel
    ckpts = tmp_path / "ckpt"  # the bucket's objects as a local folder: what was uploaded is a whole checkpoint
    for key in fs.find(f"{bucket}/fsdp"):
        local = ckpts / key.split("/fsdp/", 1)[1]
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(key, str(local))
    folders = sorted(p.name for p in ckpts.iterdir() if p.is_dir())
    assert folders == ["step=00000005.ckpt", "step=00000010.ckpt"]
    assert find_resume_checkpoint(ckpts) == str(ckpts / "step=00000010.ckpt")
    # the node holding rank 1 is gone: one rank reads both ranks' shards back from the bucket (DCP reshards) and
    # accumulates 2 to step 15; then a node joins and two ranks reshard the one-rank folder back and go on to step 20
    launch({"one": f"--max-steps 15 --sharded-checkpoints {url} --resume"}, devices=1)
    assert find_resume_checkpoint(url).endswith("step=00000015.ckpt")
    # then, in one launch: two ranks go on from the bucket, and two resume the local copy of the first run's folders
    launch(
        {
            "two": f"--max-steps 20 --sharded-checkpoints {url} --resume",
            "resumed": f"--max-steps 20 --sharded-checkpoints {ckpts} --resume",
        }
    )
    two, resumed = tmp_path / "two", tmp_path / "resumed"
    expected = torch.load(full / "weights_rank0.pt")
    for name, got in torch.load(two / "weights_rank0.pt").items():
        if name.endswith("qkv.bias"):  # the key bias cancels in softmax: AdamW turns its zero gradient's rounding
            got, expected[name] = got.view(3, -1)[0::2], expected[name].view(3, -1)[0::2]  # noise into lr-sized steps
        torch.testing.assert_close(got, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    for rank in (0, 1):
        expected = torch.load(full / f"weights_rank{rank}.pt")
        got = torch.load(resumed / f"weights_rank{rank}.pt")
        assert all(torch.equal(got[k], v) for k, v in expected.items()), f"rank {rank}: resumed weights differ"
    # keep_last=2 pruned the older folders, their manifests with them
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "step=00000015.ckpt",
        "step=00000015.ckpt.manifest.json",
        "step=00000020.ckpt",
        "step=00000020.ckpt.manifest.json",
    ]
