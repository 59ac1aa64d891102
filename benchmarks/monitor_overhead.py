"""Overhead of ThroughputCallback + UtilizationMonitor against no callbacks, on the same run.

Configurations are interleaved over several rounds and the median wall time of each is compared,
so machine noise hits both alike. The target is a ratio below 1.01.

    python benchmarks/monitor_overhead.py [--steps 150] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS, write  # noqa: E402

from lightning_accel import ThroughputCallback, UtilizationMonitor  # noqa: E402
from lightning_accel.data import SyntheticTokenDataModule  # noqa: E402
from lightning_accel.models import TinyGPT  # noqa: E402


def fit_seconds(monitored: bool, steps: int) -> float:
    seed_everything(0)
    model = TinyGPT(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=4)
    dm = SyntheticTokenDataModule(num_samples=16 * steps, batch_size=16)
    callbacks = [ThroughputCallback(summary=False), UtilizationMonitor(interval_s=1.0, summary=False)] if monitored else []
    trainer = Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    return time.perf_counter() - start


def run(steps: int = 150, rounds: int = 5) -> dict:
    times: dict[str, list[float]] = {"none": [], "monitored": []}
    fit_seconds(False, 10)  # warm caches and lazy imports before anything is timed
    for _ in range(rounds):
        times["none"].append(fit_seconds(False, steps))
        times["monitored"].append(fit_seconds(True, steps))
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"seconds": times, "median_seconds": median, "ratio": median["monitored"] / median["none"], "steps": steps, "target": 1.01}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    args = p.parse_args()
    result = run(args.steps, args.rounds)
    write("monitor_overhead", result, result["median_seconds"], "median fit seconds", out=args.out)
    print(f"monitored / none = {result['ratio']:.4f} (target < {result['target']})")


if __name__ == "__main__":
    main()
