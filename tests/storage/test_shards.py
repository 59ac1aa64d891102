"""Folders of shards, checked by the ranks that wrote and read them (lightning_accel/storage/shards.py), Trainer-free:
a real torch DCP folder and DeepSpeed's file names; a shard altered in place (same size) is found by the rank
whose share it is, before anything loads it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_accel.checkpoint.sharded import seal_folder, verify_folder
from lightning_accel.storage.shards import (
    CorruptShardError,
    check_share,
    shard_digests,
    share,
    verify_shards,
    writer_rank,
)


def test_the_writer_of_each_shard_and_each_ranks_share():
    names = [
        "__0_0.distcp",
        "__1_0.distcp",
        "__10_1.distcp",
        ".metadata",
        "meta.pt",
        "checkpoint/zero_pp_rank_3_mp_rank_00_optim_states.pt",
        "checkpoint/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
        "checkpoint/mp_rank_00_model_states.pt",
        "latest",
    ]
    assert [writer_rank(n) for n in names] == [0, 1, 10, None, None, 3, 2, None, None]
    assert share(names, 0, 2) == [
        "__0_0.distcp",
        "__10_1.distcp",
        "checkpoint/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
    ]
    assert share(names, 1, 2) == ["__1_0.distcp", "checkpoint/zero_pp_rank_3_mp_rank_00_optim_states.pt"]
    assert sorted(share(names, 0, 1)) == sorted(n for n in names if writer_rank(n) is not None)  # one rank: all


def test_a_shard_altered_in_place_is_found_by_the_rank_whose_share_it_is(tmp_path):
    folder = tmp_path / "step=00000010.ckpt"
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=str(folder))  # torch DCP's own writer
    digests = shard_digests(folder, rank=0)
    assert list(digests) == ["__0_0.distcp"]
    manifest = seal_folder(folder, {"global_step": 10}, digests)
    assert manifest["files"]["__0_0.distcp"]["xxh3_64"] == digests["__0_0.distcp"]
    verify_shards(folder, rank=0, world_size=1)  # intact: no error
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit flipped in place: the size is unchanged
    shard.write_bytes(bytes(data))
    assert check_share(folder, manifest, rank=1, world_size=2) is None  # not rank 1's share
    assert "its xxh3-64 checksum does not match" in check_share(folder, manifest, rank=0, world_size=2)
    with pytest.raises(CorruptShardError, match=r"rank 0: __0_0.distcp: its xxh3-64 checksum .* previous one"):
        verify_shards(folder, rank=0, world_size=1)
    assert not verify_folder(folder, json.loads((tmp_path / "step=00000010.ckpt.manifest.json").read_text()))
    shard.write_bytes(bytes(data[:-1]))  # and a torn one: its size says so
    assert "is missing or not" in check_share(folder, manifest, rank=0, world_size=1)
