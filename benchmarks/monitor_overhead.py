"""Overhead of ThroughputCallback + UtilizationMonitor against no callbacks, on the same run.

Configurations are interleaved over several rounds, so machine noise hits both alike, and the best
round of each is compared (noise only ever adds time). The headline is the steady-state time per
step (from step 20 to the last, clocked by the same tiny callback in both runs); target: a ratio
below 1.01. Medians are reported beside it. The whole-fit ratio, which also counts
one-time costs (the FLOP-counting batch, psutil/NVML setup), is reported beside it.

    python -m benchmarks.monitor_overhead [--steps 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from lightning.pytorch import Callback, seed_everything

from benchmarks.harness import RESULTS, quiet_trainer, write
from lightning_accel import ThroughputCallback, UtilizationMonitor
from lightning_accel.data import SyntheticTokenDataModule
from lightning_accel.models import TinyGPT

WARM = 20


class Clock(Callback):
    """Present in both configurations: wall time of the steps after warm-up."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == WARM:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def fit_seconds(monitored: bool, steps: int) -> tuple[float, float]:
    """Whole-fit seconds and steady-state seconds per step."""
    seed_everything(0)
    model = TinyGPT(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=4)
    dm = SyntheticTokenDataModule(num_samples=16 * steps, batch_size=16)
    clock = Clock()
    callbacks = [clock] + (
        [ThroughputCallback(summary=False), UtilizationMonitor(interval_s=1.0, summary=False)] if monitored else []
    )
    trainer = quiet_trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    return time.perf_counter() - start, (clock.end - clock.start) / (steps - WARM)


def run(steps: int = 200, rounds: int = 7) -> dict:
    if steps <= WARM:
        raise ValueError(f"steps must exceed the {WARM} warm-up steps")
    fit: dict[str, list[float]] = {"none": [], "monitored": []}
    per_step: dict[str, list[float]] = {"none": [], "monitored": []}
    fit_seconds(False, WARM + 2)  # warm caches and lazy imports before anything is timed
    for _ in range(rounds):
        for name in ("none", "monitored"):
            total, step = fit_seconds(name == "monitored", steps)
            fit[name].append(total)
            per_step[name].append(step)
    best_ms = {k: 1000 * min(v) for k, v in per_step.items()}
    median_ms = {k: 1000 * statistics.median(v) for k, v in per_step.items()}
    fit_s = {k: min(v) for k, v in fit.items()}
    return {
        "best_step_ms": best_ms,
        "median_step_ms": median_ms,
        "best_fit_seconds": fit_s,
        "ratio": best_ms["monitored"] / best_ms["none"],
        "median_ratio": median_ms["monitored"] / median_ms["none"],
        "fit_ratio": fit_s["monitored"] / fit_s["none"],
        "fit_seconds": fit,
        "step_seconds": per_step,
        "steps": steps,
        "target": 1.01,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    args = p.parse_args()
    result = run(args.steps, args.rounds)
    write("monitor_overhead", result, result["best_step_ms"], "best ms per step (steady state)", out=args.out)
    print(
        f"per step: monitored / none = {result['ratio']:.4f} (target < {result['target']}; "
        f"median {result['median_ratio']:.4f}); whole fit: {result['fit_ratio']:.4f}"
    )


if __name__ == "__main__":
    main()
