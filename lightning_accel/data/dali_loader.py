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

from lightning_accel.data.global_order import (
    LEGACY_ORDER_VERSION,
    ORDER_VERSION,
    DealtSlots,
    EpochOrder,
    check_order_version,
    slots_per_rank,
)
from lightning_accel.ranks import gather_from_ranks
from lightning_accel.storage import check_storage_url, filesystem, is_remote

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_SUFFIXES",
    "LAST_BATCH_POLICIES",
    "READER_NAME",
    "DALILoader",
    "DealtArraySource",
    "batches_per_epoch",
    "explain_dali_error",
    "find_unreadable_images",
    "scan_image_folder",
]

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp"}
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
LAST_BATCH_POLICIES = {"partial": LastBatchPolicy.PARTIAL, "drop": LastBatchPolicy.DROP, "fill": LastBatchPolicy.FILL}
READER_NAME = "Reader"


def scan_image_folder(root: str | Path) -> tuple[list[str], list[str], list[int]]:
    """Classes (sorted subfolders), image files and their labels of an ``ROOT/CLASS/IMG`` folder.

    ``root`` may be a bucket URL (``s3://bucket/train``): it is listed through fsspec, and the files are given to
    DALI's reader as URLs, which it reads itself (DALI's readers take ``s3://``, with the standard AWS variables).
    Raises a clear error for a missing folder, no class subfolders, or no images.
    """
    if is_remote(str(root)):
        check_storage_url(str(root), "data folder")
        listing = _list_bucket_folder(str(root))
    else:
        folder = Path(root)
        listing = (
            None
            if not folder.is_dir()
            else {p.name: [str(f) for f in p.iterdir()] for p in folder.iterdir() if p.is_dir()}
        )
    if listing is None:
        raise FileNotFoundError(f"Image folder {str(root)!r} does not exist (expected ROOT/CLASS_NAME/IMAGE.jpg)")
    classes = sorted(listing)
    if not classes:
        raise ValueError(f"Image folder {str(root)!r} has no class subfolders (expected ROOT/CLASS_NAME/IMAGE.jpg)")
    files, labels = [], []
    for label, name in enumerate(classes):
        for f in sorted(listing[name]):
            if Path(f).suffix.lower() in IMAGE_SUFFIXES:
                files.append(f)
                labels.append(label)
    if not files:
        raise ValueError(
            f"Image folder {str(root)!r} has class folders {classes[:5]} but no {sorted(IMAGE_SUFFIXES)} files"
        )
    return classes, files, labels


def _list_bucket_folder(url: str) -> dict[str, list[str]] | None:
    """``{class: [file URLs]}`` under a bucket prefix (one recursive listing), or ``None`` when nothing is there."""
    fs, root = filesystem(url)
    scheme = url.split("://", 1)[0]
    try:
        keys = fs.find(root)
    except FileNotFoundError:
        return None
    if not keys:
        return None
    listing: dict[str, list[str]] = {}
    for key in keys:
        parts = key[len(root) :].strip("/").split("/")
        if len(parts) == 2:  # CLASS/IMAGE: deeper keys are not this layout's
            listing.setdefault(parts[0], []).append(f"{scheme}://{key}")
    return listing


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


class DealtArraySource:
    """``external_source`` callback over in-memory arrays, dealt to the ranks as ``ResumableDataLoader`` deals: one
    global order per epoch (the seed and the epoch only), cut into slots of ``batch_size``, slot ``r + kW`` to rank
    ``r`` of ``W``, every rank as many (the epoch's first slots dealt again where they do not divide).

    Batch ``info.iteration`` of the pipeline's epoch ``info.epoch_idx`` is a pure function of the two and of where
    the pipeline started (:meth:`start_at`): that lets DALI's pipeline checkpoints restore the source exactly, and a
    resume on another number of ranks start a new pipeline at the saved point of the global order.
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
        self.first_epoch, self.first_slot = 0, 0  # where the pipeline's epoch 0 starts in the global order
        self.order_version = ORDER_VERSION  # a state from an earlier release sets the order it was made with
        self._cached: tuple[int, DealtSlots, EpochOrder] | None = None  # the pipeline epoch's slots and order

    def start_at(self, epoch: int, slot: int) -> None:
        """Make the pipeline's first epoch be ``epoch``, from global slot ``slot`` on (the slots before it trained)."""
        self.first_epoch, self.first_slot, self._cached = epoch, slot, None

    def set_order_version(self, version: int) -> None:
        """Deal from the order a loader state was saved in (:mod:`~lightning_accel.data.global_order`)."""
        self.order_version, self._cached = check_order_version(version), None

    def _rank_slots(self, pipeline_epoch: int) -> tuple[DealtSlots, EpochOrder]:
        """This rank's slots in the pipeline's epoch ``pipeline_epoch`` and that epoch's order (computed per batch;
        with ``fill`` a short last slot repeats its last sample, as DALI's FILL does)."""
        if self._cached is None or self._cached[0] != pipeline_epoch:
            start = self.first_slot if pipeline_epoch == 0 else 0
            n, epoch = len(self.images), self.first_epoch + pipeline_epoch
            drop, fill = self.last_batch == "drop", self.last_batch == "fill"
            mine = DealtSlots(n, self.batch_size, drop, start, self.num_shards, self.shard_id, fill=fill)
            order = EpochOrder(n, self.seed, epoch, self.shuffle, self.order_version)
            self._cached = (pipeline_epoch, mine, order)
        return self._cached[1], self._cached[2]

    def batches(self, pipeline_epoch: int) -> list[list[int]]:
        """This rank's batches (sample indices) in the pipeline's epoch ``pipeline_epoch`` (O(epoch): for tests)."""
        mine, order = self._rank_slots(pipeline_epoch)
        return [mine.batch(order, k) for k in range(len(mine))]

    def num_batches(self) -> int:
        """Batches one rank sees in a whole epoch: the same on every rank, and the same every epoch."""
        return slots_per_rank(len(self.images), self.batch_size, self.num_shards, self.last_batch == "drop")

    def __call__(self, info: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        mine, order = self._rank_slots(info.epoch_idx)
        if info.iteration >= len(mine):
            raise StopIteration  # DALI starts the next epoch (info.epoch_idx + 1) at the next call
        idx = mine.batch(order, info.iteration)
        return [self.images[i] for i in idx], [self.labels[i : i + 1] for i in idx]


def batches_per_epoch(shard_size: int, batch_size: int, last_batch: str) -> int:
    """Batches one rank sees per epoch: the same on every rank, and the same every epoch."""
    return shard_size // batch_size if last_batch == "drop" else math.ceil(shard_size / batch_size)


class DALILoader:
    """Iterable with a length over a DALI iterator; yields ``(images, labels)`` or ``{"images", "labels"}``.

    Its state is DALI's own pipeline checkpoint (reader positions, random generators), which Lightning
    stores in its checkpoints and hands back on resume: the iterator is rebuilt from it, so a mid-epoch
    resume continues with exactly the batches and augmentations the uninterrupted run would have seen.
    Over arrays (a :class:`DealtArraySource`) the state also holds the point reached in the epoch's global order,
    so a resume on another number of ranks goes on from there (:attr:`follows_world_size`); DALI's file reader
    saves a position inside its own shard, which no other split can continue.
    """

    def __init__(
        self,
        build: Callable[[str | None], DALIGenericIterator],
        as_dict: bool,
        source: str,
        shard_id: int = 0,
        length: int | None = None,
        last_size: int | None = None,
        num_shards: int = 1,
        dealt: DealtArraySource | None = None,
        same_order_every_epoch: bool = False,
    ) -> None:
        self._build, self.as_dict, self.source, self.shard_id = build, as_dict, source, shard_id
        self.num_shards, self.dealt, self.same_order_every_epoch = num_shards, dealt, same_order_every_epoch
        self.iterator = build(None)
        self.length = len(self.iterator) if length is None else length
        # The epoch's last batch is cut to this many samples: DALI fills it (FILL) and we cut it to the
        # size every rank shares, because its PARTIAL policy hands a short shard an empty batch.
        self.last_size = last_size
        self._handed = 0  # batches handed out this epoch: says which batch is the last after a resume
        self._resumed = False
        self.epoch, self._next_epoch = 0, 0  # the epoch being handed out, counted by __iter__
        self._said_unfinished = False

    @property
    def follows_world_size(self) -> bool:
        """Whether PreemptionCheckpoint may resume this loader on another number of ranks (arrays: yes)."""
        return self.dealt is not None

    # Read by PreemptionCheckpoint when it refuses a resume on another number of ranks.
    world_change_fix = (
        "DALI's file reader saves a position inside its own shard. Give DALIImageDataModule train_arrays= (its "
        "source deals one global order, as ResumableDataLoader does, and follows a change), or"
    )

    def _global_position(self) -> dict[str, int]:
        """The next batch's place in the global order: its epoch and the slots of it trained (all ranks together)."""
        if self._handed >= self.length:
            return {"epoch": self.epoch + 1, "slot": 0}
        return {"epoch": self.epoch, "slot": self._handed * self.num_shards}

    def state_dict(self) -> dict[str, Any]:
        """DALI's checkpoint of every rank's pipeline (indexed by shard) at the last batch handed out, and where the
        run stands in the global order (over arrays).

        Lightning writes the checkpoint from rank 0 only, so each rank's pipeline state (its own reader
        position and augmentation generators) is gathered here; it calls this on every rank.
        """
        by_shard = dict(gather_from_ranks((self.shard_id, self.iterator.checkpoints()[0])))
        state: dict[str, Any] = {
            "dali_checkpoints": [by_shard[i] for i in sorted(by_shard)],
            "batches_in_epoch": self._handed,
            "world_size": self.num_shards,
            "epoch": self.epoch,
        }
        if self.dealt is not None:
            first = {"epoch": self.dealt.first_epoch, "slot": self.dealt.first_slot}
            state.update(batch_size=self.dealt.batch_size, position=self._global_position(), pipeline_start=first)
            state["order"] = self.dealt.order_version
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rebuild the pipeline from this shard's checkpoint made by :meth:`state_dict`; over arrays saved on another
        number of ranks, start a new pipeline at the saved point of the global order."""
        checkpoints = state.get("dali_checkpoints")
        if not checkpoints:
            raise ValueError(f"DALILoader state has no DALI checkpoint: got keys {sorted(state)}")
        saved_world = int(state.get("world_size", len(checkpoints)))
        if self.dealt is not None:  # a state without a version: the earlier release's order, kept for this run
            self.dealt.set_order_version(int(state.get("order", LEGACY_ORDER_VERSION)))
        if saved_world != self.num_shards and self.follows_world_size and "position" in state:
            self._go_on_from(state, saved_world)
            return
        if saved_world != self.num_shards or self.shard_id >= len(checkpoints):
            raise ValueError(
                f"the checkpoint holds DALI reader states of {len(checkpoints)} shards, this is shard {self.shard_id} "
                f"of {self.num_shards}: DALI's readers save a position within their own shard, which does not map "
                f"onto another split. Resume on {saved_world} rank(s), give DALIImageDataModule train_arrays= "
                "(dealt from one global order), or train from lightning_accel.ResumableDataLoader to resume on any "
                "number (docs/checkpointing.md, 'Another world size')"
            )
        if self.dealt is not None and "pipeline_start" in state:
            self.dealt.start_at(int(state["pipeline_start"]["epoch"]), int(state["pipeline_start"]["slot"]))
        self.iterator = self._build(checkpoints[self.shard_id])
        self._handed, self._resumed = int(state.get("batches_in_epoch", 0)), True
        self.epoch = int(state.get("epoch", 0))

    def _go_on_from(self, state: dict[str, Any], saved_world: int) -> None:
        assert self.dealt is not None
        epoch, slot = int(state["position"]["epoch"]), int(state["position"]["slot"])
        if int(state.get("batch_size", self.dealt.batch_size)) != self.dealt.batch_size or slot % self.num_shards:
            raise ValueError(
                f"DALILoader: the checkpoint stopped {slot} batches of {state.get('batch_size')} into epoch {epoch} "
                f"on {saved_world} rank(s), which is not a whole number of batches of {self.dealt.batch_size} on each "
                f"of {self.num_shards}. Resume with the batch size that saved on a number of ranks that divides the "
                "saved global batch (PreemptionCheckpoint checks this when the checkpoint loads)."
            )
        self.dealt.start_at(epoch, slot)
        self.iterator = self._build(None)  # DALI's per-shard states do not split; the global position does
        self._handed, self._resumed, self.epoch = slot // self.num_shards, True, epoch
        log.info(
            "DALI: shard %d of %d goes on from slot %d of epoch %d (saved on %d rank(s))",
            self.shard_id,
            self.num_shards,
            slot,
            epoch,
            saved_world,
        )

    def __len__(self) -> int:
        return self.length

    def _start_afresh_after_an_unfinished_epoch(self) -> None:
        """The last pass stopped early (Lightning's sanity check takes 2 batches; ``limit_*_batches``): DALI would
        go on with the rest of that epoch, so the next pass would start mid-epoch, its batches rotated and a folder's
        cut last batch in the wrong place. A pipeline whose order can be placed (arrays) or never changes (no
        shuffle: validation) is built again at the next epoch's start. A shuffling file reader cannot be placed, and
        reading the rest of its epoch would decode what ``limit_train_batches`` meant to skip: it goes on (said once).
        """
        if self.dealt is not None or self.same_order_every_epoch:
            if self.dealt is not None:
                self.dealt.start_at(self._next_epoch, 0)
            self.iterator = self._build(None)
        elif not self._said_unfinished:
            self._said_unfinished = True
            log.warning(
                "DALI: a training pass over %s stopped after %d of %d batches (limit_train_batches?); DALI's file "
                "reader goes on with the rest of that epoch's order in the next pass, whose last batch may hold "
                "repeated samples. Train on whole epochs, or give DALIImageDataModule train_arrays=.",
                self.source,
                self._handed,
                self.length,
            )

    def __iter__(self) -> Iterator[Any]:
        if self._resumed:
            self._next_epoch = self.epoch + 1
        else:
            if 0 < self._handed < self.length:
                self._start_afresh_after_an_unfinished_epoch()
            self._handed, self.epoch, self._next_epoch = 0, self._next_epoch, self._next_epoch + 1
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
        self._handed, self.epoch = 0, self._next_epoch  # a state saved now points at the next epoch's start


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
