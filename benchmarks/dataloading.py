"""DALI CPU pipeline vs a torch DataLoader doing the same augmentation with the same worker count.

Both decode JPEGs, random-resized-crop, flip and normalize to CHW float32; images/s is measured over
full epochs, side by side in one run. ``--gpu`` adds DALI's ``mixed`` (nvJPEG) decode on the GPU.

    python -m benchmarks.dataloading [--images 384] [--workers 2] [--gpu]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from benchmarks.harness import RESULTS, write
from lightning_accel.data import DALIImageDataModule
from lightning_accel.data.dali import IMAGENET_MEAN, IMAGENET_STD, scan_image_folder


def make_images(root: Path, count: int, size: int = 256) -> None:
    rng = np.random.default_rng(0)
    for k in range(count):
        folder = root / f"class_{k % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        # smooth noise compresses like a photo, unlike white noise
        small = rng.integers(0, 255, (size // 16, size // 16, 3), dtype=np.uint8)
        Image.fromarray(small).resize((size, size), Image.BILINEAR).save(folder / f"{k}.jpg", quality=90)


class TorchAugmented(Dataset):
    """PIL decode + random resized crop + flip + normalize: what DALI's training pipeline does."""

    def __init__(self, root: Path, out: int) -> None:
        _, self.files, self.labels = scan_image_folder(root)
        self.out = out
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        img = Image.open(self.files[i]).convert("RGB")
        w, h = img.size
        area = w * h * random.uniform(0.08, 1.0)
        ratio = random.uniform(3 / 4, 4 / 3)
        cw, ch = min(w, int((area * ratio) ** 0.5)), min(h, int((area / ratio) ** 0.5))
        x, y = random.randint(0, w - cw), random.randint(0, h - ch)
        img = img.crop((x, y, x + cw, y + ch)).resize((self.out, self.out), Image.BILINEAR)
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        t = torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1)
        return (t - self.mean) / self.std, self.labels[i]


def images_per_sec(loader, epochs: int) -> float:
    for _ in loader:  # warm-up epoch: worker start, DALI prefetch
        pass
    start, n = time.perf_counter(), 0
    for _ in range(epochs):
        for images, _ in loader:
            n += images.shape[0]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def run(
    images: int = 384, workers: int = 2, batch: int = 32, out: int = 128, epochs: int = 2, gpu: bool = False
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_images(root, images)
        torch_loader = DataLoader(
            TorchAugmented(root, out),
            batch_size=batch,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
        )
        rows = {f"torch DataLoader ({workers} workers)": images_per_sec(torch_loader, epochs)}
        dali = DALIImageDataModule(
            train_dir=str(root), batch_size=batch, image_size=out, num_threads=workers, device="cpu"
        )
        dali.setup("fit")
        rows[f"DALI cpu ({workers} threads)"] = images_per_sec(dali.train_dataloader(), epochs)
        if gpu:
            dali_gpu = DALIImageDataModule(
                train_dir=str(root), batch_size=batch, image_size=out, num_threads=workers, device="gpu"
            )
            dali_gpu.setup("fit")
            rows["DALI gpu (mixed decode)"] = images_per_sec(dali_gpu.train_dataloader(), epochs)
    base = next(iter(rows.values()))
    return {
        "images_per_sec": rows,
        "ratio_vs_torch": {k: v / base for k, v in rows.items()},
        "images": images,
        "batch": batch,
        "out_size": out,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--images", type=int, default=384)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    args = p.parse_args()
    result = run(args.images, args.workers, gpu=args.gpu)
    write("dataloading" + ("_gpu" if args.gpu else ""), result, result["images_per_sec"], "images/s", out=args.out)
    for name, ips in result["images_per_sec"].items():
        print(f"{name:>28}: {ips:8.1f} images/s  x{result['ratio_vs_torch'][name]:.2f}")


if __name__ == "__main__":
    main()
