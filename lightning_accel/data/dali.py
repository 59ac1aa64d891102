"""DALI image DataModule: decode and augment on the GPU (``mixed``/``gpu``), or on DALI's CPU backend.

Both backends run the same pipeline graph, so the API and the batch format do not change with the
hardware. Shards by rank, reproducible under a seed, and yields ``(images, labels)`` (or dicts).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp"}
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
_POLICIES = {"partial": LastBatchPolicy.PARTIAL, "drop": LastBatchPolicy.DROP, "fill": LastBatchPolicy.FILL}
_READER = "Reader"


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
    from PIL import Image

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


class _ArrayShardSource:
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
        own = self.iterator.checkpoints()[0]
        state: dict[str, Any] = {"dali_checkpoints": [own], "batches_in_epoch": self._handed}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (self.shard_id, own))
            by_shard = dict(gathered)
            state["dali_checkpoints"] = [by_shard[i] for i in sorted(by_shard)]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rebuild the pipeline from this shard's checkpoint made by :meth:`state_dict`."""
        checkpoints = state.get("dali_checkpoints")
        if not checkpoints:
            raise ValueError(f"DALILoader state has no DALI checkpoint: got keys {sorted(state)}")
        if self.shard_id >= len(checkpoints):
            raise ValueError(
                f"the checkpoint holds DALI states for {len(checkpoints)} shards, this is shard {self.shard_id}: "
                "resuming with a different world size is not exact (see docs/checkpointing.md)"
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


class DALIImageDataModule(LightningDataModule):
    """Image classification data through DALI, from a folder (``ROOT/CLASS/IMG.jpg``) or numpy arrays.

    Training augmentation: random resized crop, horizontal flip, optional color jitter, normalize, CHW.
    From a folder, the crop is fused into the decoder (``fn.decoders.image_random_crop``), so only the
    kept region of a JPEG is decoded. Validation: resize the shorter side to
    ``image_size / center_crop_ratio``, center crop, normalize. With CUDA, JPEG decoding is ``mixed``
    (nvJPEG, and the hardware JPEG decoder where the GPU has one), augmentation runs on the GPU and the
    batches arrive on the training device; otherwise DALI's CPU backend runs the same graph
    (``device_id=None``).

    Every rank sees the same number of batches, every epoch: shards are padded to ``ceil(N / ranks)``
    samples by repeating samples, as Lightning's ``DistributedSampler`` does.

    Args:
        train_dir / val_dir: Image folders (class subfolders); or give ``train_arrays`` / ``val_arrays``.
        train_arrays / val_arrays: ``(images uint8 (N,H,W,3), labels int (N,))``.
        batch_size: Per-rank batch size.
        image_size: Output height and width.
        mean / std: Normalization in 0-255 pixel units (default: ImageNet).
        flip_prob: Probability of a horizontal flip in training.
        color_jitter: Brightness/contrast/saturation jitter strength (0 disables it).
        scale: Area range of the random resized crop.
        ratio: Aspect-ratio (width / height) range of the random resized crop.
        center_crop_ratio: Validation crop size over resize size.
        last_batch: ``"partial"`` (smaller last batch), ``"drop"``, or ``"fill"`` (pad by repeating samples).
        device: ``"auto"`` (GPU if available), ``"gpu"`` or ``"cpu"``.
        num_threads: DALI CPU worker threads (default: the CPU cores this process may use, shared
            among the node's ranks).
        prefetch_queue_depth: Batches DALI prepares ahead of the one being trained on.
        stick_to_shard: Keep each rank on its own files every epoch (shuffled within the shard) instead
            of one global shuffle per epoch: less reading from remote storage, less mixing.
        hw_decoder_load: Share of JPEGs sent to the GPU's hardware decoder (``mixed`` only; default DALI's).
        exec_dynamic: DALI's dynamic executor (``None``: DALI's default).
        seed: Shuffle and augmentation seed (augmentation is offset by rank).
        as_dict: Yield ``{"images", "labels"}`` instead of a tuple.
        shard_id / num_shards: Override the shard (default: the trainer's global rank and world size).
    """

    def __init__(
        self,
        train_dir: str | None = None,
        val_dir: str | None = None,
        train_arrays: tuple[np.ndarray, np.ndarray] | None = None,
        val_arrays: tuple[np.ndarray, np.ndarray] | None = None,
        batch_size: int = 64,
        image_size: int = 224,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        flip_prob: float = 0.5,
        color_jitter: float = 0.0,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        center_crop_ratio: float = 0.875,
        last_batch: Literal["partial", "drop", "fill"] = "partial",
        device: Literal["auto", "gpu", "cpu"] = "auto",
        num_threads: int | None = None,
        prefetch_queue_depth: int = 2,
        stick_to_shard: bool = False,
        hw_decoder_load: float | None = None,
        exec_dynamic: bool | None = None,
        seed: int = 0,
        as_dict: bool = False,
        shard_id: int | None = None,
        num_shards: int | None = None,
    ) -> None:
        super().__init__()
        if (shard_id is None) != (num_shards is None) or (num_shards is not None and not 0 <= shard_id < num_shards):
            raise ValueError(
                f"shard_id and num_shards go together with 0 <= shard_id < num_shards, got {shard_id}, {num_shards}"
            )
        if train_dir is None and train_arrays is None:
            raise ValueError("DALIImageDataModule needs train_dir= (an image folder) or train_arrays=(images, labels)")
        if last_batch not in _POLICIES:
            raise ValueError(f"last_batch must be one of {sorted(_POLICIES)}, got {last_batch!r}")
        if (num_threads is not None and num_threads < 1) or prefetch_queue_depth < 1:
            raise ValueError(
                f"num_threads and prefetch_queue_depth must be at least 1, got {num_threads}, {prefetch_queue_depth}"
            )
        if hw_decoder_load is not None and not 0.0 <= hw_decoder_load <= 1.0:
            raise ValueError(f"hw_decoder_load is a share between 0 and 1, got {hw_decoder_load}")
        if device == "gpu" and not torch.cuda.is_available():
            raise ValueError("device='gpu' was requested but no CUDA device is visible; use device='auto' or 'cpu'")
        for name, arrays in (("train_arrays", train_arrays), ("val_arrays", val_arrays)):
            if arrays is not None:
                images, labels = arrays
                if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8 or len(images) != len(labels):
                    raise ValueError(
                        f"{name} must be (uint8 images (N,H,W,3), labels (N,)), "
                        f"got {images.shape} {images.dtype} and {len(labels)} labels"
                    )
        self.save_hyperparameters(ignore=["train_arrays", "val_arrays"])
        self.train_dir, self.val_dir = train_dir, val_dir
        # DALI takes densely packed arrays only: a transposed or sliced view is copied once here.
        self.train_arrays, self.val_arrays = (
            None if arrays is None else (np.ascontiguousarray(arrays[0]), np.asarray(arrays[1]))
            for arrays in (train_arrays, val_arrays)
        )
        self.use_gpu = device == "gpu" or (device == "auto" and torch.cuda.is_available())
        self.classes: list[str] = []
        self._train_files: tuple[list[str], list[int]] | None = None
        self._val_files: tuple[list[str], list[int]] | None = None

    # -- sharding -----------------------------------------------------------------------------------
    def _shard(self) -> tuple[int, int]:
        if self.hparams.num_shards is not None:
            return self.hparams.shard_id, self.hparams.num_shards
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        return 0, 1

    def _num_threads(self) -> int:
        if self.hparams.num_threads is not None:
            return self.hparams.num_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if self.trainer is not None:
            per_node = max(per_node, len(self.trainer.device_ids))
        return max(1, cores // per_node)

    def _device_id(self) -> int | None:
        if not self.use_gpu:
            return None
        if self.trainer is not None:
            return self.trainer.strategy.root_device.index
        return torch.cuda.current_device()

    def setup(self, stage: str | None = None) -> None:
        if self.train_dir is not None:
            self.classes, files, labels = scan_image_folder(self.train_dir)
            # DALI's shuffle_after_epoch uses a fixed seed of its own; permuting the list it starts from
            # by our seed makes the order depend on `seed` while staying identical on every rank.
            order = np.random.default_rng(self.hparams.seed).permutation(len(files))
            self._train_files = ([files[i] for i in order], [labels[i] for i in order])
            log.info("DALI: %d training images in %d classes under %s", len(files), len(self.classes), self.train_dir)
        if self.val_dir is not None:
            _, files, labels = scan_image_folder(self.val_dir)
            self._val_files = (files, labels)

    # -- pipelines ----------------------------------------------------------------------------------
    def _decode_kwargs(self) -> dict[str, Any]:
        if not self.use_gpu:
            return {}
        # nvJPEG buffers sized for ImageNet-like JPEGs up front (DALI's ResNet-50 example), so they are not
        # reallocated in the first epochs.
        kw: dict[str, Any] = {"device_memory_padding": 211_025_920, "host_memory_padding": 140_544_512}
        if self.hparams.hw_decoder_load is not None:
            kw["hw_decoder_load"] = self.hparams.hw_decoder_load
        return kw

    def _reader(self, file_list: tuple[list[str], list[int]], train: bool, shard_id: int, num_shards: int) -> Any:
        hp = self.hparams
        if train and hp.stick_to_shard:
            order: dict[str, Any] = {"stick_to_shard": True, "random_shuffle": True, "seed": hp.seed}
        else:
            # One global permutation per epoch with the same seed on every rank, so shards never overlap.
            order = {"shuffle_after_epoch": train, "shuffle_after_epoch_seed": hp.seed} if train else {}
        return fn.readers.file(
            files=file_list[0],
            labels=file_list[1],
            shard_id=shard_id,
            num_shards=num_shards,
            pad_last_batch=True,  # every rank's shard has the same length: the largest one's
            name=_READER,
            **order,
        )

    def _augment(self, images: Any, encoded: Any, train: bool) -> Any:
        """The training or validation graph after reading: ``encoded`` is set for files, else decoded arrays."""
        hp = self.hparams
        decode_device, aug_device = ("mixed", "gpu") if self.use_gpu else ("cpu", "cpu")
        size = (hp.image_size, hp.image_size)
        if train:
            if encoded is not None:
                # Decode only the region the random crop keeps (libjpeg-turbo / nvJPEG ROI decode).
                images = fn.decoders.image_random_crop(
                    encoded,
                    device=decode_device,
                    output_type=types.RGB,
                    random_area=list(hp.scale),
                    random_aspect_ratio=list(hp.ratio),
                    **self._decode_kwargs(),
                )
                images = fn.resize(images, size=size, device=aug_device)
            else:
                images = fn.random_resized_crop(
                    images, size=size, random_area=list(hp.scale), random_aspect_ratio=list(hp.ratio), device=aug_device
                )
            if hp.color_jitter > 0:
                j = hp.color_jitter
                images = fn.color_twist(
                    images,
                    brightness=fn.random.uniform(range=(1 - j, 1 + j)),
                    contrast=fn.random.uniform(range=(1 - j, 1 + j)),
                    saturation=fn.random.uniform(range=(1 - j, 1 + j)),
                    device=aug_device,
                )
            mirror, crop = fn.random.coin_flip(probability=hp.flip_prob), None
        else:
            if encoded is not None:
                kw = self._decode_kwargs()
                images = fn.decoders.image(encoded, device=decode_device, output_type=types.RGB, **kw)
            images = fn.resize(images, resize_shorter=round(hp.image_size / hp.center_crop_ratio), device=aug_device)
            mirror, crop = 0, size
        return fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            crop=crop,
            mean=list(hp.mean),
            std=list(hp.std),
            mirror=mirror,
            device=aug_device,
        )

    def _loader(self, train: bool) -> DALILoader:
        hp = self.hparams
        shard_id, num_shards = self._shard()
        folder = self.train_dir if train else self.val_dir
        file_list = self._train_files if train else self._val_files
        if folder is not None and file_list is None:
            raise RuntimeError("DALIImageDataModule.setup() must run before its dataloaders are requested")
        arrays = self.train_arrays if train else self.val_arrays
        source_name = str(folder or "arrays")  # named in error messages
        policy = hp.last_batch if train else "partial"
        source: _ArrayShardSource | None = None
        if folder is None:
            assert arrays is not None
            source = _ArrayShardSource(
                *arrays, hp.batch_size, shard_id, num_shards, shuffle=train, seed=hp.seed, last_batch=policy
            )

        @pipeline_def
        def pipeline() -> tuple[Any, Any]:
            if source is None:
                encoded, labels = self._reader(file_list, train, shard_id, num_shards)
                images = self._augment(None, encoded, train)
            else:
                images, labels = fn.external_source(
                    source=source,
                    num_outputs=2,
                    batch=True,
                    batch_info=True,
                    dtype=[types.UINT8, types.INT64],
                    layout=["HWC", ""],
                )
                images = self._augment(images.gpu() if self.use_gpu else images, None, train)
            return images, labels.gpu() if self.use_gpu else labels

        last_size = None
        if source is None:
            total = len(file_list[0])
            shard_size = math.ceil(total / num_shards)
            length = batches_per_epoch(shard_size, hp.batch_size, policy)
            if policy == "partial" and shard_size % hp.batch_size:
                last_size = shard_size - (length - 1) * hp.batch_size
            reader_policy = "fill" if policy == "partial" else policy
        else:
            length = source.num_batches()

        def build(checkpoint: str | None) -> DALIGenericIterator:
            pipe = pipeline(
                batch_size=hp.batch_size,
                num_threads=self._num_threads(),
                device_id=self._device_id(),
                seed=hp.seed + 1000 * shard_id + (0 if train else 1),  # augmentation differs per rank
                prefetch_queue_depth=hp.prefetch_queue_depth,
                enable_checkpointing=train,
                checkpoint=checkpoint,
                exec_dynamic=hp.exec_dynamic,
            )
            try:
                pipe.build()
                # Constructing the iterator already runs the pipeline (prefetch), so decode errors show here too.
                return DALIGenericIterator(
                    pipe,
                    ["images", "labels"],
                    reader_name=_READER if source is None else None,
                    last_batch_policy=_POLICIES[reader_policy] if source is None else LastBatchPolicy.PARTIAL,
                    auto_reset=True,
                )
            except RuntimeError as err:
                raise explain_dali_error(err, source_name) from err

        return DALILoader(
            build, as_dict=hp.as_dict, source=source_name, shard_id=shard_id, length=length, last_size=last_size
        )

    def train_dataloader(self) -> DALILoader:
        return self._loader(train=True)

    def val_dataloader(self) -> DALILoader | list:
        if self.val_dir is None and self.val_arrays is None:
            return []
        return self._loader(train=False)
