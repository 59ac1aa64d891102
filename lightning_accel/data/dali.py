"""DALI image DataModule: decode and augment on the GPU (``mixed``/``gpu``), or on DALI's CPU backend.

Both backends run the same pipeline graph, so the API and the batch format do not change with the
hardware. Shards by rank, reproducible under a seed, and yields ``(images, labels)`` (or dicts).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
from typing_extensions import override

from lightning_accel.data.dali_loader import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    LAST_BATCH_POLICIES,
    READER_NAME,
    DALILoader,
    DealtArraySource,
    batches_per_epoch,
    explain_dali_error,
    scan_image_folder,
)
from lightning_accel.host import usable_cores

__all__ = ["DALIImageDataModule"]

log = logging.getLogger(__name__)


class DALIImageDataModule(LightningDataModule):
    """Image classification data through DALI, from a folder (``ROOT/CLASS/IMG.jpg``) or numpy arrays.

    Training augmentation: random resized crop, horizontal flip, optional color jitter, normalize, CHW.
    From a folder, the crop is fused into the decoder (``fn.decoders.image_random_crop``), so only the
    kept region of a JPEG is decoded. Validation: resize the shorter side to
    ``image_size / center_crop_ratio``, center crop, normalize. With CUDA, JPEG decoding is ``mixed``
    (nvJPEG, and the hardware JPEG decoder where the GPU has one), augmentation runs on the GPU and the
    batches arrive on the training device; otherwise DALI's CPU backend runs the same graph
    (``device_id=None``).

    Every rank sees the same number of batches, every epoch: a folder's shards are padded to ``ceil(N / ranks)``
    samples by repeating samples, as Lightning's ``DistributedSampler`` does. Arrays are dealt as
    ``ResumableDataLoader`` deals: one global order per epoch, a batch at a time round robin (the epoch's first
    batches dealt again where they do not divide), so a ``PreemptionCheckpoint`` run over arrays resumes on another
    number of ranks; a folder's DALI file reader can resume only on the number that saved.

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
        if last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(f"last_batch must be one of {sorted(LAST_BATCH_POLICIES)}, got {last_batch!r}")
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
        cores = usable_cores()
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

    @override
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
            # One global permutation per epoch with the same seed on every rank, so shards never overlap. Validation
            # keeps each rank on its shard (DALI's reader moves to the next one each epoch otherwise), so every
            # validation reads the same files in the same order and can be restarted at its first batch.
            order = (
                {"shuffle_after_epoch": True, "shuffle_after_epoch_seed": hp.seed}
                if train
                else {"stick_to_shard": True}
            )
        return fn.readers.file(
            files=file_list[0],
            labels=file_list[1],
            shard_id=shard_id,
            num_shards=num_shards,
            pad_last_batch=True,  # every rank's shard has the same length: the largest one's
            name=READER_NAME,
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
        source: DealtArraySource | None = None
        if folder is None:
            assert arrays is not None
            source = DealtArraySource(
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
                seed=self._pipeline_seed(shard_id, train, source),
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
                    reader_name=READER_NAME if source is None else None,
                    last_batch_policy=LAST_BATCH_POLICIES[reader_policy] if source is None else LastBatchPolicy.PARTIAL,
                    auto_reset=True,
                )
            except RuntimeError as err:
                raise explain_dali_error(err, source_name) from err

        return DALILoader(
            build,
            as_dict=hp.as_dict,
            source=source_name,
            shard_id=shard_id,
            length=length,
            last_size=last_size,
            num_shards=num_shards,
            dealt=source,
            same_order_every_epoch=not train,
        )

    def _pipeline_seed(self, shard_id: int, train: bool, source: DealtArraySource | None) -> int:
        """Augmentation differs per rank; a pipeline started mid-run on another number of ranks (``source``'s start)
        draws from a seed of its own, the same on every resume of that checkpoint."""
        seed = self.hparams.seed + 1000 * shard_id + (0 if train else 1)
        if source is not None and (source.first_epoch, source.first_slot) != (0, 0):
            seed = int(np.random.SeedSequence([seed, source.first_epoch, source.first_slot]).generate_state(1)[0])
        return seed

    @override
    def train_dataloader(self) -> DALILoader:
        return self._loader(train=True)

    @override
    def val_dataloader(self) -> DALILoader | list:
        if self.val_dir is None and self.val_arrays is None:
            return []
        return self._loader(train=False)
