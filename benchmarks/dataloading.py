"""DALI's pipeline vs a tuned torch DataLoader doing the same augmentation on the same cores (issue #16).

The data is ImageNet-like: JPEGs of 500x375 and 375x500 (quality 90, about 100 KB each, photo-like
content: smooth shapes and fine grain), trained at 224x224. Both sides decode, random-resized-crop
(area 0.08-1, aspect 3/4-4/3), flip and normalize to CHW float32 batches:

- ``torch``: a PIL Dataset (the crop fused into the resize with ``box=``, the cheapest PIL way) in a
  DataLoader with ``workers`` processes, ``persistent_workers``, ``pin_memory`` where CUDA is present,
  and the better of ``prefetch_factor`` 2 and 4 (picked by a first pass);
- ``dali_cpu``: ``DALIImageDataModule(device="cpu", num_threads=workers)``: ROI decode of the kept crop
  (``fn.decoders.image_random_crop``), resize, fused flip+normalize;
- ``dali_gpu`` (``--gpu``): the same DataModule with ``mixed`` nvJPEG decode, batches on the GPU.

Rounds alternate the order of the variants; each round runs every variant over ``epochs`` full epochs
after a warm-up epoch. Reported: images/s and CPU seconds per image (this process and its workers,
from psutil), per round and the median, and DALI / torch per round (the headline is their median);
and, to show where DALI's CPU time goes, its graph cut after each stage on one thread (full decode
for comparison, ROI decode, resize, flip + normalize).

    python -m benchmarks.dataloading [--images 512] [--workers 2] [--rounds 5] [--gpu]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from benchmarks.harness import RESULTS, save_figure, write_json
from lightning_accel.data import DALIImageDataModule
from lightning_accel.data.dali import IMAGENET_MEAN, IMAGENET_STD, scan_image_folder
from lightning_accel.figures import pyplot

OUT = 224
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


def make_images(root: Path, count: int) -> float:
    """Write ``count`` photo-like JPEGs of 500x375 (landscape) and 375x500 (portrait); returns mean KB."""
    rng = np.random.default_rng(0)
    sizes = []
    for k in range(count):
        folder = root / f"class_{k % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        shapes = rng.integers(0, 255, (15, 20, 3), dtype=np.uint8)  # smooth regions, like objects and sky
        smooth = np.asarray(Image.fromarray(shapes).resize((500, 375), Image.BICUBIC)).astype(np.int16)
        grain = rng.normal(0, 20, smooth.shape).astype(np.int16)  # texture: what makes a photo ~100 KB
        image = Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))
        if k % 2:
            image = image.transpose(Image.Transpose.ROTATE_90)
        path = folder / f"{k}.jpg"
        image.save(path, quality=90)
        sizes.append(path.stat().st_size)
    return float(np.mean(sizes)) / 1024


class TorchAugmented(Dataset):
    """PIL decode, random resized crop fused into the resize, flip, normalize: DALI's training graph."""

    def __init__(self, root: Path, out: int = OUT) -> None:
        _, self.files, self.labels = scan_image_folder(root)
        self.out = out
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = Image.open(self.files[i]).convert("RGB")
        w, h = img.size
        area = w * h * random.uniform(*SCALE)
        ratio = random.uniform(*RATIO)
        cw, ch = min(w, round((area * ratio) ** 0.5)), min(h, round((area / ratio) ** 0.5))
        x, y = random.randint(0, w - cw), random.randint(0, h - ch)
        img = img.resize((self.out, self.out), Image.BILINEAR, box=(x, y, x + cw, y + ch))
        if random.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        t = torch.from_numpy(np.array(img, dtype=np.float32)).permute(2, 0, 1)
        return (t - self.mean) / self.std, self.labels[i]


def cpu_seconds() -> float:
    """User + system CPU time of this process and all its live children (DataLoader workers)."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def measure(loader: Iterable, epochs: int) -> dict[str, float]:
    """Images/s and CPU ms per image over ``epochs`` full epochs, after one warm-up epoch."""
    for _ in loader:  # warm-up: worker start, DALI prefetch, page cache
        pass
    cpu0, start, n = cpu_seconds(), time.perf_counter(), 0
    for _ in range(epochs):
        for images, _ in loader:
            n += images.shape[0]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    return {"images_per_sec": n / wall, "cpu_ms_per_image": 1000 * cpu / n}


def torch_loader(root: Path, workers: int, batch: int, prefetch_factor: int) -> DataLoader:
    return DataLoader(
        TorchAugmented(root),
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=prefetch_factor if workers > 0 else None,
        pin_memory=torch.cuda.is_available(),
    )


def dali_loader(root: Path, workers: int, batch: int, device: str) -> Any:
    dm = DALIImageDataModule(train_dir=str(root), batch_size=batch, image_size=OUT, num_threads=workers, device=device)
    dm.setup("fit")
    return dm.train_dataloader()


def stage_costs(root: Path, batch: int, batches: int = 8) -> dict[str, float]:
    """CPU ms per image of DALI's CPU graph cut after each stage, on one thread: where the time goes."""
    from nvidia.dali import fn, pipeline_def, types

    _, files, labels = scan_image_folder(root)

    def graph(stage: str) -> Any:
        encoded, _ = fn.readers.file(files=files, labels=labels, shuffle_after_epoch=True)
        if stage == "full decode":
            return fn.decoders.image(encoded, device="cpu", output_type=types.RGB)
        images = fn.decoders.image_random_crop(
            encoded, device="cpu", output_type=types.RGB, random_area=list(SCALE), random_aspect_ratio=list(RATIO)
        )
        if stage == "ROI decode":
            return images
        images = fn.resize(images, size=(OUT, OUT))
        if stage == "+ resize":
            return images
        return fn.crop_mirror_normalize(
            images, dtype=types.FLOAT, output_layout="CHW", mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD)
        )

    costs = {}
    for stage in ("full decode", "ROI decode", "+ resize", "+ flip, normalize"):
        pipe = pipeline_def(lambda stage=stage: graph(stage))(batch_size=batch, num_threads=1, device_id=None, seed=0)
        pipe.build()
        pipe.run()  # warm-up
        start = cpu_seconds()
        for _ in range(batches):
            pipe.run()
        costs[stage] = 1000 * (cpu_seconds() - start) / (batches * batch)
    return costs


def run(
    images: int = 512, workers: int = 2, batch: int = 64, epochs: int = 2, rounds: int = 5, gpu: bool = False
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        mean_kb = make_images(root, images)
        stages = stage_costs(root, batch)
        # Tune the DataLoader first: the better prefetch depth on this machine, one epoch each.
        tuning = {pf: measure(torch_loader(root, workers, batch, pf), 1)["images_per_sec"] for pf in (2, 4)}
        prefetch = max(tuning, key=tuning.get)
        loaders: dict[str, Any] = {
            "torch": torch_loader(root, workers, batch, prefetch),
            "dali_cpu": dali_loader(root, workers, batch, "cpu"),
        }
        if gpu:
            loaders["dali_gpu"] = dali_loader(root, workers, batch, "gpu")
        per_round: list[dict[str, dict[str, float]]] = []
        for r in range(rounds):
            names = list(loaders) if r % 2 == 0 else list(reversed(loaders))
            per_round.append({name: measure(loaders[name], epochs) for name in names})
    median = {
        name: {k: statistics.median(rnd[name][k] for rnd in per_round) for k in ("images_per_sec", "cpu_ms_per_image")}
        for name in loaders
    }
    ratios = {
        name: [rnd[name]["images_per_sec"] / rnd["torch"]["images_per_sec"] for rnd in per_round]
        for name in loaders
        if name != "torch"
    }
    return {
        "config": {
            "images": images,
            "mean_jpeg_kb": round(mean_kb, 1),
            "source_sizes": ["500x375", "375x500"],
            "out_size": OUT,
            "batch": batch,
            "workers": workers,
            "epochs_per_round": epochs,
            "rounds": rounds,
            "torch_prefetch_factor": prefetch,
            "torch_prefetch_tuning_images_per_sec": tuning,
            "cpu_cores": len(psutil.Process().cpu_affinity() or []) or psutil.cpu_count(),
        },
        "dali_cpu_ms_per_image_by_stage_1_thread": stages,
        "median": median,
        "ratio_vs_torch_median": {name: statistics.median(v) for name, v in ratios.items()},
        "ratio_vs_torch_rounds": ratios,
        "rounds": per_round,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    names = list(result["median"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label in (
        (axes[0], "images_per_sec", "images/s (higher is better)"),
        (axes[1], "cpu_ms_per_image", "CPU ms per image (lower is better)"),
    ):
        values = [result["median"][n][key] for n in names]
        bars = ax.bar(names, values, color=["#999999", "#4C72B0", "#55A868"][: len(names)])
        ax.bar_label(bars, fmt="%.3g")
        ax.set_title(label, fontsize=10)
    c = result["config"]
    ratio = result["ratio_vs_torch_median"]["dali_cpu"]
    fig.suptitle(
        f"{c['source_sizes'][0]} JPEGs ({c['mean_jpeg_kb']} KB) to {c['out_size']}px, {c['workers']} workers, "
        f"{c['cpu_cores']} cores: DALI cpu / torch = {ratio:.2f}x (median of {c['rounds']} rounds)",
        fontsize=10,
    )
    save_figure(fig, path)


def write(name: str, result: dict[str, Any], out: Path = RESULTS) -> Path:
    path = write_json(name, result, out)
    plot(result, out / f"{name}.png")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers = DALI threads")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2, help="measured epochs per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gpu", action="store_true", help="add DALI mixed (nvJPEG) decode on the GPU")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    args = p.parse_args()
    result = run(args.images, args.workers, args.batch, args.epochs, args.rounds, gpu=args.gpu)
    write("dataloading" + ("_gpu" if args.gpu else ""), result, out=args.out)
    for name, m in result["median"].items():
        ratio = result["ratio_vs_torch_median"].get(name, 1.0)
        print(
            f"{name:>9}: {m['images_per_sec']:7.1f} images/s  {m['cpu_ms_per_image']:5.2f} CPU ms/image  x{ratio:.2f}"
        )
    stages = result["dali_cpu_ms_per_image_by_stage_1_thread"]
    print("DALI CPU ms per image, one thread: " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))


if __name__ == "__main__":
    main()
