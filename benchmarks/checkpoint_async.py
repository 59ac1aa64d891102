"""Training stall per checkpoint: synchronous atomic writes vs async (copy, then write in a thread).

The stall is the time ``PreemptionCheckpoint.save`` blocks the training loop. Both modes run the
same model in one process, alternating, and the ratio sync/async is printed.

    python -m benchmarks.checkpoint_async [--params-m 25] [--saves 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, quiet_trainer, write
from lightning_accel import PreemptionCheckpoint
from lightning_accel.data import SyntheticClassificationDataModule
from lightning_accel.models import MLPClassifier


class TimedCheckpoint(PreemptionCheckpoint):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stalls: list[float] = []

    def save(self, trainer):
        start = time.perf_counter()
        path = super().save(trainer)
        self.stalls.append(time.perf_counter() - start)
        return path


def stalls(async_save: bool, hidden: int, saves: int, folder: Path, gpu: bool = False) -> tuple[list[float], int]:
    model = MLPClassifier(input_dim=hidden, hidden_dim=hidden, num_layers=2, num_classes=4, lr=0.01)
    cb = TimedCheckpoint(
        folder / ("async" if async_save else "sync"), every_n_steps=2, keep_last=2, async_save=async_save
    )
    trainer = quiet_trainer(
        accelerator="gpu" if gpu else "cpu",
        max_steps=2 * saves,
        callbacks=[cb],
    )
    trainer.fit(
        model, datamodule=SyntheticClassificationDataModule(num_samples=64 * saves, input_dim=hidden, batch_size=16)
    )
    return cb.stalls, sum(p.numel() for p in model.parameters())


def run(params_m: float = 25, saves: int = 4, gpu: bool = False) -> dict:
    hidden = int((params_m * 1e6 / 3) ** 0.5)  # three hidden x hidden weight matrices
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent) as tmp:
        sync, n = stalls(False, hidden, saves, Path(tmp), gpu)
        asyn, _ = stalls(True, hidden, saves, Path(tmp), gpu)
    med = {"sync": statistics.median(sync), "async": statistics.median(asyn)}
    return {
        "stall_seconds": {"sync": sync, "async": asyn},
        "median_stall_seconds": med,
        "ratio_sync_over_async": med["sync"] / med["async"],
        "params": n,
        # plain SGD keeps no optimizer state, so the file is the fp32 weights
        "checkpoint_mb": n * 4 / 1e6,
        "sync_write_mb_per_sec": n * 4 / 1e6 / med["sync"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--params-m", type=float, default=25)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    args = p.parse_args()
    torch.set_num_threads(2)
    result = run(args.params_m, args.saves, args.gpu)
    write("checkpoint_async", result, result["median_stall_seconds"], "median stall per checkpoint (s)", out=args.out)
    med = result["median_stall_seconds"]
    print(
        f"stall per checkpoint: sync {med['sync']:.3f}s, async {med['async']:.3f}s "
        f"-> x{result['ratio_sync_over_async']:.1f} less stall"
    )


if __name__ == "__main__":
    main()
