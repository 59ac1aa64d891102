"""Overhead of GoodputMonitor + UtilizationMonitor, and of Lightning's ThroughputMonitor, against no callbacks.

On the tiny GPT (about 40 ms a step on 2 cores), configurations interleaved over several rounds in a rotating
order so machine noise hits all alike: steady-state time per step (step 20 to the last, clocked by the same
tiny callback in every run), best round (noise only ever adds time) and median, as a ratio to no callbacks;
target below 1.01. The whole-fit ratio, which also counts one-time costs (the FLOP-counting batch,
psutil/NVML setup), is beside it. On a shared 2-core VM round-to-round noise is several percent, more than
the overhead itself, so one more run per monitor adds up the time spent inside the monitors' own code
(every hook they define, and the ledger's profiler calls): the resolvable number, in microseconds per step.

    python -m benchmarks.monitor_overhead [--steps 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ThroughputMonitor

from benchmarks.harness import RESULTS, quiet_trainer, write
from lightning_accel import GoodputMonitor, UtilizationMonitor
from lightning_accel.demos import SyntheticTokenDataModule, TinyGPT
from lightning_accel.monitor.batches import default_batch_size
from lightning_accel.monitor.ledger import LedgerProfiler

WARM = 20


class Clock(Callback):
    """Present in every configuration: wall time of the steps after warm-up (and the monitors' self time)."""

    def __init__(self, timer: SelfTimer | None = None) -> None:
        self.timer = timer

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == WARM:
            self.start = time.perf_counter()
            if self.timer is not None:
                self.timer_start = self.timer.spent
        self.end = time.perf_counter()
        if self.timer is not None and trainer.global_step > WARM:
            self.timer.steady = self.timer.spent - self.timer_start


CONFIGS = ("none", "ours", "lightning")


def monitors(config: str) -> list[Callback]:
    if config == "ours":  # the ledger with throughput/MFU, and host/GPU telemetry every second
        return [GoodputMonitor(summary=False, plot=False), UtilizationMonitor(every_n_seconds=1.0, summary=False)]
    if config == "lightning":
        return [ThroughputMonitor(batch_size_fn=default_batch_size)]
    return []


class SelfTimer:
    """Adds up the wall time spent inside the monitors' own code: every hook their classes define, and the
    ledger's profiler calls. Lightning's dispatch around a hook is not in it (the ledger's profiler makes
    that dispatch cheaper than Lightning's default for the ~30 actions a batch that charge no bucket)."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start

        return timed

    def instrument(self, callbacks: list[Callback]) -> None:
        for cb in callbacks:
            for cls in type(cb).__mro__:
                if cls in (Callback, object):
                    break
                for name, fn in vars(cls).items():
                    if callable(fn) and name.startswith("on_") and name not in vars(cb):
                        setattr(cb, name, self.wrap(getattr(cb, name)))


def fit_seconds(config: str, steps: int, timer: SelfTimer | None = None) -> tuple[float, float]:
    """Whole-fit seconds and steady-state seconds per step."""
    seed_everything(0)
    clock = Clock(timer)
    callbacks = monitors(config)
    if timer is not None:
        timer.instrument(callbacks)
    trainer = quiet_trainer(accelerator="cpu", max_steps=steps, callbacks=[clock, *callbacks])
    gpt = TinyGPT(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=4)
    start = time.perf_counter()
    trainer.fit(gpt, datamodule=SyntheticTokenDataModule(num_samples=16 * steps, batch_size=16))
    return time.perf_counter() - start, (clock.end - clock.start) / (steps - WARM)


def self_cost(config: str, steps: int) -> float:
    """Seconds per steady-state step spent inside the monitors' own code."""
    timer = SelfTimer()
    patched = {name: getattr(LedgerProfiler, name) for name in ("profile", "start", "stop")}
    try:
        for name, fn in patched.items():
            setattr(LedgerProfiler, name, timer.wrap(fn))
        fit_seconds(config, steps, timer)
    finally:
        for name, fn in patched.items():
            setattr(LedgerProfiler, name, fn)
    return timer.steady / (steps - WARM)


def run(steps: int = 200, rounds: int = 7) -> dict:
    if steps <= WARM:
        raise ValueError(f"steps must exceed the {WARM} warm-up steps")
    fit: dict[str, list[float]] = {c: [] for c in CONFIGS}
    per_step: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for config in CONFIGS:
        fit_seconds(config, WARM + 2)  # warm caches and lazy imports before anything is timed
    for i in range(rounds):
        for name in CONFIGS[i % 3 :] + CONFIGS[: i % 3]:  # rotated: no configuration always runs first
            total, step = fit_seconds(name, steps)
            fit[name].append(total)
            per_step[name].append(step)
    cost_us = {k: 1e6 * self_cost(k, steps) for k in ("ours", "lightning")}
    best_ms = {k: 1000 * min(v) for k, v in per_step.items()}
    median_ms = {k: 1000 * statistics.median(v) for k, v in per_step.items()}
    fit_s = {k: min(v) for k, v in fit.items()}
    return {
        "best_step_ms": best_ms,
        "median_step_ms": median_ms,
        "best_fit_seconds": fit_s,
        "ratio": best_ms["ours"] / best_ms["none"],
        "median_ratio": median_ms["ours"] / median_ms["none"],
        "fit_ratio": fit_s["ours"] / fit_s["none"],
        "lightning_ratio": best_ms["lightning"] / best_ms["none"],
        "lightning_median_ratio": median_ms["lightning"] / median_ms["none"],
        "self_time_us_per_step": cost_us,
        "self_time_share_of_step": {k: v / (1000 * best_ms["none"]) for k, v in cost_us.items()},
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
        f"per step: ours / none = {result['ratio']:.4f} (target < {result['target']}; "
        f"median {result['median_ratio']:.4f}); whole fit: {result['fit_ratio']:.4f}; "
        f"Lightning ThroughputMonitor / none = {result['lightning_ratio']:.4f} "
        f"(median {result['lightning_median_ratio']:.4f})"
    )
    cost, share = result["self_time_us_per_step"], result["self_time_share_of_step"]
    print(
        f"time inside the monitors' own code per step: ours {cost['ours']:.1f} us ({share['ours']:.2%} of a step), "
        f"Lightning ThroughputMonitor {cost['lightning']:.1f} us ({share['lightning']:.2%})"
    )


if __name__ == "__main__":
    main()
