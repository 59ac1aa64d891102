"""DALI DataModule on DALI's CPU backend, with small images written by a fixture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from PIL import Image
from torch import nn

pytest.importorskip(
    "nvidia.dali", reason="nvidia-dali-cuda120 is not installed (a project dependency; the H200 image lacks it)"
)

from lightning_accel.data import DALIImageDataModule
from lightning_accel.data.dali import IMAGENET_MEAN, IMAGENET_STD
from lightning_accel.monitor import GoodputMonitor
from tests.conftest import requires_cuda, tiny_trainer_kwargs

N, CLASSES = 24, 3
MEAN, STD = (100.0, 50.0, 20.0), (50.0, 25.0, 10.0)


def color(k: int) -> tuple[int, int, int]:
    """Solid colour of image k: red encodes its id, green its class (lossless in PNG)."""
    return 10 * k, 50 * (k % CLASSES), 100


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("images")
    for k in range(N):
        folder = root / f"class_{k % CLASSES}"
        folder.mkdir(exist_ok=True)
        Image.new("RGB", (24 + k % 5, 20 + k % 3), color(k)).save(folder / f"img_{k:02d}.png")
    return root


def make(image_dir, **kw) -> DALIImageDataModule:
    kw = {
        "train_dir": str(image_dir),
        "batch_size": 4,
        "image_size": 8,
        "mean": MEAN,
        "std": STD,
        "num_threads": 1,
        "device": "cpu",
        **kw,
    }
    dm = DALIImageDataModule(**kw)
    dm.setup("fit")
    return dm


def ids(images: torch.Tensor) -> list[int]:
    red = images[:, 0].mean(dim=(1, 2)) * STD[0] + MEAN[0]
    return [round(v / 10) for v in red.tolist()]


def epoch_ids(loader) -> list[int]:
    return [i for images, _ in loader for i in ids(images)]


def test_shapes_dtypes_and_normalization(image_dir):
    images, labels = next(iter(make(image_dir).train_dataloader()))
    assert images.shape == (4, 3, 8, 8) and images.dtype == torch.float32 and images.device.type == "cpu"
    assert labels.shape == (4,) and labels.dtype == torch.int64
    for img, label, k in zip(images, labels, ids(images), strict=True):
        assert label.item() == k % CLASSES  # folder label matches the image's own class
        expected = [(c - m) / s for c, m, s in zip(color(k), MEAN, STD, strict=True)]
        for channel in range(3):  # a solid colour survives crop, resize and flip unchanged
            torch.testing.assert_close(img[channel], torch.full((8, 8), expected[channel]), atol=0.02, rtol=0)


def test_seeded_runs_are_identical_and_seed_matters(image_dir):
    a, b = make(image_dir, seed=3).train_dataloader(), make(image_dir, seed=3).train_dataloader()
    for _ in range(2):
        for (xa, ya), (xb, yb) in zip(a, b, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    first = epoch_ids(make(image_dir, seed=3).train_dataloader())
    assert first != epoch_ids(make(image_dir, seed=4).train_dataloader())


def test_two_shards_are_disjoint_and_cover_every_epoch(image_dir):
    shards = [make(image_dir, shard_id=i, num_shards=2).train_dataloader() for i in range(2)]
    assert [len(s) for s in shards] == [3, 3]  # 12 images per shard, batches of 4
    orders = []
    for _ in range(3):
        s0, s1 = epoch_ids(shards[0]), epoch_ids(shards[1])
        assert len(s0) == len(s1) == 12
        assert set(s0).isdisjoint(s1)
        assert sorted(s0 + s1) == list(range(N))
        orders.append(s0)
    assert orders[0] != orders[1]  # reshuffled every epoch


@pytest.mark.parametrize(("policy", "sizes"), [("partial", [5, 5, 2]), ("drop", [5, 5]), ("fill", [5, 5, 5])])
def test_last_batch_policy(image_dir, policy, sizes):
    loader = make(image_dir, batch_size=5, shard_id=1, num_shards=2, last_batch=policy).train_dataloader()
    assert len(loader) == len(sizes)
    for _ in range(2):
        assert [x.shape[0] for x, _ in loader] == sizes


def test_validation_is_deterministic_center_crop(image_dir):
    dm = make(image_dir, val_dir=str(image_dir), as_dict=True)
    val = dm.val_dataloader()
    first = [b["images"] for b in val]
    second = [b["images"] for b in val]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert sorted(i for batch in first for i in ids(batch)) == list(range(N))  # in order, no shuffle needed
    assert first[0].shape == (4, 3, 8, 8)


def test_numpy_array_source_shards_and_normalizes():
    images = np.stack([np.full((12, 10, 3), color(k), dtype=np.uint8) for k in range(N)])
    labels = np.arange(N) % CLASSES
    seen = []
    for shard in range(2):
        dm = DALIImageDataModule(
            train_arrays=(images, labels),
            batch_size=4,
            image_size=6,
            mean=MEAN,
            std=STD,
            num_threads=1,
            device="cpu",
            shard_id=shard,
            num_shards=2,
        )
        loader = dm.train_dataloader()
        assert len(loader) == 3
        e1, e2 = epoch_ids(loader), epoch_ids(loader)
        assert len(e1) == 12 and sorted(e1) == sorted(set(e1))
        assert e1 != e2  # a new permutation each epoch
        seen.append(set(e1))
        x, y = next(iter(loader))
        assert x.shape == (4, 3, 6, 6) and torch.equal(y, torch.tensor([k % CLASSES for k in ids(x)]))
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(range(N))


class TinyCNN(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES)
        )

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trains_with_lightning(image_dir, tmp_path):
    dm = DALIImageDataModule(train_dir=str(image_dir), batch_size=4, image_size=16, num_threads=1, device="cpu")
    cb = GoodputMonitor(summary=False, warmup_steps=0, plot=False)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_epochs=2, callbacks=[cb]))
    trainer.fit(TinyCNN(), datamodule=dm)
    assert trainer.global_step == 2 * 6  # 24 images / 4 per batch, two epochs
    assert cb.results["throughput/samples_per_sec"] > 0


def test_bad_folders_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make(tmp_path / "nope")
    with pytest.raises(ValueError, match="no class subfolders"):
        make(tmp_path)
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"no .* files"):
        make(tmp_path)
    with pytest.raises(ValueError, match="needs train_dir"):
        DALIImageDataModule()
    with pytest.raises(ValueError, match="last_batch must be one of"):
        DALIImageDataModule(train_dir=str(tmp_path), last_batch="wrap")


def test_unreadable_image_is_named(image_dir, tmp_path):
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    for k in range(3):
        Image.new("RGB", (8, 8), color(k)).save(root / "a" / f"ok{k}.png")
    (root / "a" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(RuntimeError, match=r"could not decode an image under .*broken\.jpg"):
        loader = make(root).train_dataloader()
        for _ in loader:
            pass


@requires_cuda
def test_gpu_mixed_decode(image_dir, tmp_path):
    """nvJPEG (hardware decoder share set) with ROI decode for training, full decode for validation: batches
    arrive on the GPU with the CPU backend's shapes and the same solid colours."""
    jpegs = tmp_path / "jpegs"
    for k in range(8):
        (jpegs / f"class_{k % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (64, 48), color(k)).save(jpegs / f"class_{k % 2}" / f"{k}.jpg", quality=95)
    dm = DALIImageDataModule(
        train_dir=str(jpegs), val_dir=str(jpegs), batch_size=4, image_size=8, device="gpu", hw_decoder_load=0.75
    )
    dm.setup("fit")
    images, labels = next(iter(dm.train_dataloader()))
    assert images.device.type == "cuda" and images.shape == (4, 3, 8, 8) and images.dtype == torch.float32
    assert labels.device.type == "cuda" and labels.shape == (4,)
    val = [x for x, _ in dm.val_dataloader()]
    assert [x.shape[0] for x in val] == [4, 4] and val[0].device.type == "cuda"
    cpu = make(jpegs, val_dir=str(jpegs), image_size=8, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    torch.testing.assert_close(val[0].cpu(), next(iter(cpu.val_dataloader()))[0], atol=0.1, rtol=0)


def write_id_images(root: Path, count: int) -> Path:
    for k in range(count):
        folder = root / f"class_{k % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (24 + k % 5, 20 + k % 3), color(k)).save(folder / f"{k}.png")
    return root


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_ranks_see_equal_batches_and_fixed_lengths_every_epoch(tmp_path):
    """25 images on 2 gloo ranks, batches of 4, three epochs, for folders and arrays and each last-batch policy:
    both ranks train the same number of batches, none empty (BatchNorm in the model), ``len()`` is the same before
    and after every epoch and matches what each rank trains, and every sample is trained each epoch. A folder's
    shards are 12 and 13 (the short one repeats a sample, as DistributedSampler does, and the last batch is cut to
    1 on both ranks); arrays are dealt a batch at a time from one global order, so the short 7th batch goes to
    rank 0 and rank 1 takes the epoch's first batch again."""
    root = write_id_images(tmp_path / "images", 25)
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).parent / "dali_ddp_epochs.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), str(root), str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    folder = {"partial": [4, 4, 4, 1], "drop": [4, 4, 4], "fill": [4, 4, 4, 4]}
    expected = {
        **{("folder", policy, rank): sizes for policy, sizes in folder.items() for rank in (0, 1)},
        ("arrays", "partial", 0): [4, 4, 4, 1],
        ("arrays", "partial", 1): [4, 4, 4, 4],
        **{("arrays", policy, rank): folder[policy] for policy in ("drop", "fill") for rank in (0, 1)},
    }
    for case, epochs_rank0 in ranks[0].items():
        source, policy = case.split("-")
        for epoch, (e0, e1) in enumerate(zip(epochs_rank0, ranks[1][case], strict=True)):
            for rank, e in enumerate((e0, e1)):
                sizes = [len(b) for b in e["train"]]
                assert sizes == expected[source, policy, rank], (case, epoch, rank, sizes)
                assert e["len_start"] == e["len_end"] == e["num_training_batches"] == len(sizes), (case, epoch, e)
                val = expected[source, "partial", rank]  # validation is always partial
                assert [len(b) for b in e["val"]] == val, (case, epoch)
            trained = [i for b in e0["train"] + e1["train"] for i in b]
            if policy != "drop":
                assert set(trained) == set(range(25)), (case, epoch)
            assert {i for b in e0["val"] + e1["val"] for i in b} == set(range(25)), (case, epoch)
        assert epochs_rank0[0]["train"] != epochs_rank0[1]["train"], case  # reshuffled each epoch


@pytest.mark.parametrize("stick_to_shard", [False, True])
def test_resume_mid_epoch_cuts_the_right_last_batch(tmp_path, stick_to_shard):
    """A folder of 25 on shard 0 of 2 (12 images, the short shard), batches of 5, partial: [5, 5, 3] with the
    cut filled batch. Stopped after one batch and rebuilt from the state, the rest of the epoch and the next
    epoch are bitwise what the uninterrupted loader gives, including the cut; for both reading orders."""
    root = write_id_images(tmp_path / "images", 25)

    def loader():
        return make(root, batch_size=5, shard_id=0, num_shards=2, stick_to_shard=stick_to_shard).train_dataloader()

    whole = loader()
    reference = [[x for x, _ in whole] for _ in range(2)]
    assert [len(x) for x in reference[0]] == [5, 5, 3]
    first = loader()
    it = iter(first)
    assert torch.equal(next(it)[0], reference[0][0])
    state = first.state_dict()
    assert state["batches_in_epoch"] == 1
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [x for x, _ in resumed]
    assert len(rest) == 2 and all(torch.equal(a, b) for a, b in zip(rest, reference[0][1:], strict=True))
    assert all(torch.equal(a, b) for a, b in zip([x for x, _ in resumed], reference[1], strict=True))


def test_a_pass_stopped_early_leaves_the_next_one_whole(image_dir, caplog):
    """Lightning's sanity check takes 2 validation batches and stops; ``limit_train_batches`` stops an epoch early.
    The next validation starts at its first batch, not where DALI stopped (folder, with its cut last batch of 2 on
    shard 1; arrays): the whole set in order, every time. A training epoch over arrays cut short is followed by the
    next epoch of an uninterrupted loader; a shuffling file reader cannot be placed, goes on, and says so once."""
    images = np.stack([np.full((12, 10, 3), color(k), dtype=np.uint8) for k in range(N)])
    arrays = {"train_dir": None, "train_arrays": (images, np.arange(N)), "val_arrays": (images[:10], np.arange(10))}
    folder = {"val_dir": str(image_dir), "batch_size": 5, "shard_id": 1, "num_shards": 2}
    for kw in (folder, arrays):
        val = make(image_dir, **kw).val_dataloader()
        expected = [ids(x) for x, _ in val]
        it = iter(val)
        assert [ids(next(it)[0]) for _ in range(2)] == expected[:2]  # the sanity check
        assert [ids(x) for x, _ in val] == expected and [ids(x) for x, _ in val] == expected, kw
    assert [len(b) for b in expected] == [4, 4, 2]  # arrays: 10 in batches of 4
    reference = make(image_dir, **arrays).train_dataloader()
    epochs = [epoch_ids(reference) for _ in range(3)]
    train = make(image_dir, **arrays).train_dataloader()
    next(iter(train))  # an epoch cut short after one batch
    assert epoch_ids(train) == epochs[1] and epoch_ids(train) == epochs[2]
    files = make(image_dir).train_dataloader()
    for _ in range(2):
        next(iter(files))
    assert caplog.text.count("DALI's file reader goes on with the rest of that epoch's order") == 1


def test_stick_to_shard_keeps_each_rank_on_its_files(image_dir):
    shards = [make(image_dir, shard_id=i, num_shards=2, stick_to_shard=True).train_dataloader() for i in range(2)]
    epochs = [[epoch_ids(s) for _ in range(3)] for s in shards]
    for own in epochs:
        assert len({frozenset(e) for e in own}) == 1 and all(len(e) == 12 for e in own)  # same files each epoch
        assert len({tuple(e) for e in own}) > 1  # shuffled inside the shard
    assert set(epochs[0][0]).isdisjoint(epochs[1][0]) and set(epochs[0][0]) | set(epochs[1][0]) == set(range(N))


def test_speed_knobs_are_checked_and_threads_default_to_the_cores(image_dir, monkeypatch):
    with pytest.raises(ValueError, match="at least 1, got 0, 2"):
        DALIImageDataModule(train_dir=str(image_dir), num_threads=0)
    with pytest.raises(ValueError, match="at least 1, got None, 0"):
        DALIImageDataModule(train_dir=str(image_dir), prefetch_queue_depth=0)
    with pytest.raises(ValueError, match=r"hw_decoder_load is a share between 0 and 1, got 1\.5"):
        DALIImageDataModule(train_dir=str(image_dir), hw_decoder_load=1.5)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert DALIImageDataModule(train_dir=str(image_dir))._num_threads() == 2  # 16 cores over 8 ranks
    assert DALIImageDataModule(train_dir=str(image_dir), num_threads=5)._num_threads() == 5
    dm = make(image_dir, num_threads=None, prefetch_queue_depth=3, exec_dynamic=True)
    assert [x.shape[0] for x, _ in dm.train_dataloader()] == [4] * 6


def test_a_folder_in_a_bucket_reads_and_resumes_exactly_as_a_local_one(tmp_path, bucket, s3_server, monkeypatch):
    """JPEGs in s3://bucket/train/CLASS/ (moto's S3 server on 127.0.0.1), read by DALI's own file reader from the
    store: every batch equals the same folder's on local disk, and a loader stopped after one batch and rebuilt from
    its state goes on with the uninterrupted run's batches, into the next epoch."""
    import fsspec

    local = tmp_path / "jpegs"
    for k in range(25):
        (local / f"class_{k % CLASSES}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (24, 20), color(k)).save(local / f"class_{k % CLASSES}" / f"img_{k:02d}.jpg", quality=95)
    fs = fsspec.filesystem("s3")
    for path in sorted(local.rglob("*.jpg")):
        fs.put_file(str(path), f"{bucket}/train/{path.parent.name}/{path.name}")
    url = f"s3://{bucket}/train"
    # DALI's reader straight to the server: the tests' proxy runs on Python threads of this process, which a
    # pipeline waiting for its output would starve of the GIL
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.target_url)

    def loader(root):
        return make(root, batch_size=5, shard_id=0, num_shards=2).train_dataloader()

    whole = loader(local)
    reference = [[x for x, _ in whole] for _ in range(2)]
    from_bucket = loader(url)
    got = [[x for x, _ in from_bucket] for _ in range(2)]
    assert [[ids(x) for x in epoch] for epoch in got] == [[ids(x) for x in epoch] for epoch in reference]
    assert all(torch.equal(a, b) for e, r in zip(got, reference, strict=True) for a, b in zip(e, r, strict=True))
    first = loader(url)
    it = iter(first)
    assert torch.equal(next(it)[0], reference[0][0])
    resumed = loader(url)
    resumed.load_state_dict(first.state_dict())
    rest = [x for x, _ in resumed] + [x for x, _ in resumed]
    assert all(torch.equal(a, b) for a, b in zip(rest, reference[0][1:] + reference[1], strict=True))
    with pytest.raises(FileNotFoundError, match=r"s3://.*/nothing-here.* does not exist"):
        make(f"s3://{bucket}/nothing-here")
