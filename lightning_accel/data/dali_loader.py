"""The DALI loader and its sources: image folders and array shards read per rank, an iterator that carries its
position (``state_dict``) and cuts every rank's epoch to the same number of batches, and DALI's errors made to
name the bad folder or file. The pipeline itself is built by :class:`~lightning_accel.data.dali.DALIImageDataModule`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
from PIL import Image

from lightning_accel.ranks import gather_from_ranks

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp"}
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
LAST_BATCH_POLICIES = {"partial": LastBatchPolicy.PARTIAL, "drop": LastBatchPolicy.DROP, "fill": LastBatchPolicy.FILL}
READER_NAME = "Reader"


def scan_image_folder(root: str | Path) -> tuple[list[str], list[str], list[int]]:
    """Classes (sorted subfolders), image files and their labels of an ``ROOT/CLASS/IMG`` folder.

    Raises a clear error for a missing folder, no class subfolders, or no images.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"Image folder {str(root)!r} does not exist (expected ROOT/CLASS_NAME/IMAGE.jpg)")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f"Image folder {str(root)!r} has no class subfolders (expected ROOT/CLASS_NAME/IMAGE.jpg)")
    files, labels = [], []
    for label, name in enumerate(classes):
        for f in sorted((root / name).iterdir()):
            if f.suffix.lower() in IMAGE_SUFFIXES:
                files.append(str(f))
                labels.append(label)
    if not files:
        raise ValueError(
            f"Image folder {str(root)!r} has class folders {classes[:5]} but no {sorted(IMAGE_SUFFIXES)} files"
        )
    return classes, files, labels


def find_unreadable_images(root: str | Path, limit: int = 5) -> list[str]:
    """Files under ``root`` that Pillow cannot decode (used to name the culprit when DALI fails)."""
    bad = []
    for path in sorted(Path(root).rglob("*")):
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        try:
            with Image.open(path) as im:
                im.load()
        except Exception:
            bad.append(str(path))
            if len(bad) >= limit:
                break
    return bad


class ArrayShardSource:
    """``external_source`` callback over in-memory arrays: this shard's slice of a per-epoch permutation.

    Stateless: batch ``info.iteration`` of epoch ``info.epoch_idx`` is a pure function of the two, which
    is what lets DALI's pipeline checkpoints restore an external source exactly.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        batch_size: int,
        shard_id: int,
        num_shards: int,
        shuffle: bool,
        seed: int,
        last_batch: str,
    ) -> None:
        self.images, self.labels = images, labels.astype(np.int64)
        self.batch_size, self.shard_id, self.num_shards = batch_size, shard_id, num_shards
        self.shuffle, self.seed, self.last_batch = shuffle, seed, last_batch

    def _bounds(self) -> tuple[int, int]:
        # Same contiguous split as DALI's readers: shard i gets [n*i/k, n*(i+1)/k).
        n = len(self.images)
        return n * self.shard_id // self.num_shards, n * (self.shard_id + 1) // self.num_shards

    def shard_size(self) -> int:
        # Every rank gets ceil(n/k) samples (the short shards repeat their last one), as Lightning's
        # DistributedSampler does: unequal batch counts would leave one DDP rank waiting for good.
        return math.ceil(len(self.images) / self.num_shards)

    def shard_indices(self, epoch: int) -> np.ndarray:
        n = len(self.images)
        order = np.random.default_rng(self.seed + epoch).permutation(n) if self.shuffle else np.arange(n)
        start, end = self._bounds()
        own = order[start:end]
        return np.concatenate([own, np.repeat(own[-1:], self.shard_size() - len(own))])

    def num_batches(self) -> int:
        return batches_per_epoch(self.shard_size(), self.batch_size, self.last_batch)

    def __call__(self, info: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if info.iteration >= self.num_batches():
            raise StopIteration  # DALI starts the next epoch (info.epoch_idx + 1) at the next call
        idx = self.shard_indices(info.epoch_idx)[
            info.iteration * self.batch_size : (info.iteration + 1) * self.batch_size
        ]
        if len(idx) < self.batch_size and self.last_batch == "fill":  # pad with the last sample, like DALI's FILL
            idx = np.concatenate([idx, np.repeat(idx[-1:], self.batch_size - len(idx))])
        return [self.images[i] for i in idx], [self.labels[i : i + 1] for i in idx]


def batches_per_epoch(shard_size: int, batch_size: int, last_batch: str) -> int:
    """Batches one rank sees per epoch: the same on every rank, and the same every epoch."""
    return shard_size // batch_size if last_batch == "drop" else math.ceil(shard_size / batch_size)


class DALILoader:
    """Iterable with a length over a DALI iterator; yields ``(images, labels)`` or ``{"images", "labels"}``.

    Its state is DALI's own pipeline checkpoint (reader positions, random generators), which Lightning
    stores in its checkpoints and hands back on resume: the iterator is rebuilt from it, so a mid-epoch
    resume continues with exactly the batches and augmentations the uninterrupted run would have seen.
    """

    def __init__(
        self,
        build: Callable[[str | None], DALIGenericIterator],
        as_dict: bool,
        source: str,
        shard_id: int = 0,
        length: int | None = None,
        last_size: int | None = None,
    ) -> None:
        self._build, self.as_dict, self.source, self.shard_id = build, as_dict, source, shard_id
        self.iterator = build(None)
        self.length = len(self.iterator) if length is None else length
        # The epoch's last batch is cut to this many samples: DALI fills it (FILL) and we cut it to the
        # size every rank shares, because its PARTIAL policy hands a short shard an empty batch.
        self.last_size = last_size
        self._handed = 0  # batches handed out this epoch: says which batch is the last after a resume
        self._resumed = False

    def state_dict(self) -> dict[str, Any]:
        """DALI's checkpoint of every rank's pipeline (indexed by shard) at the last batch handed out.

        Lightning writes the checkpoint from rank 0 only, so each rank's pipeline state (its own reader
        position and augmentation generators) is gathered here; it calls this on every rank.
        """
        by_shard = dict(gather_from_ranks((self.shard_id, self.iterator.checkpoints()[0])))
        return {"dali_checkpoints": [by_shard[i] for i in sorted(by_shard)], "batches_in_epoch": self._handed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rebuild the pipeline from this shard's checkpoint made by :meth:`state_dict`."""
        checkpoints = state.get("dali_checkpoints")
        if not checkpoints:
            raise ValueError(f"DALILoader state has no DALI checkpoint: got keys {sorted(state)}")
        if self.shard_id >= len(checkpoints):
            raise ValueError(
                f"the checkpoint holds DALI reader states of {len(checkpoints)} shards, this is shard {self.shard_id}: "
                "DALI's readers save a position within their own shard, which does not map onto another split. "
                f"Resume on {len(checkpoints)} rank(s), or train from lightning_accel.ResumableDataLoader to resume "
                "on any number (docs/checkpointing.md, 'Another world size')"
            )
        self.iterator = self._build(checkpoints[self.shard_id])
        self._handed, self._resumed = int(state.get("batches_in_epoch", 0)), True

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Any]:
        if not self._resumed:
            self._handed = 0
        self._resumed = False
        try:
            for out in self.iterator:  # auto_reset: the next __iter__ starts the next epoch
                images, labels = out[0]["images"], out[0]["labels"].view(-1).long()
                self._handed += 1
                if self.last_size is not None and self._handed == self.length:
                    images, labels = images[: self.last_size], labels[: self.last_size]
                yield {"images": images, "labels": labels} if self.as_dict else (images, labels)
        except RuntimeError as err:
            raise explain_dali_error(err, self.source) from err
        self._handed = 0


def explain_dali_error(err: RuntimeError, source: str) -> RuntimeError:
    """Turn DALI's pipeline error into one that names the folder and, for decode errors, the bad files."""
    text = str(err)
    last = text.strip().splitlines()[-1] if text.strip() else ""
    if "nvImageCodec" in text or "decode" in text.lower():  # "decode" also matches fn.decoders.image
        bad = find_unreadable_images(source) if Path(source).is_dir() else []
        named = f" Unreadable files: {bad}." if bad else ""
        return RuntimeError(
            f"DALI could not decode an image under {source!r}.{named} Remove or re-encode it. (DALI: {last})"
        )
    return RuntimeError(f"DALI pipeline over {source!r} failed: {text}")
