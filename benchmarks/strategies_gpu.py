"""Single-GPU strategy check: plain single device vs the accel_zero2 preset (DeepSpeed ZeRO-2) vs accel_fsdp.

One GPU shows that the presets run and what their bookkeeping costs; the sharding itself pays off
only across several GPUs.

    python -m benchmarks.strategies_gpu [--steps 60] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from lightning.pytorch import seed_everything

import lightning_accel  # noqa: F401
from benchmarks.harness import RESULTS, quiet_trainer, write
from lightning_accel import GoodputMonitor
from lightning_accel.demos import SyntheticTokenDataModule, TinyGPT


def measure(strategy: str, steps: int) -> dict[str, float]:
    seed_everything(0)
    model = TinyGPT(vocab_size=8192, seq_len=512, d_model=512, n_layers=8, n_heads=8)
    dm = SyntheticTokenDataModule(
        num_samples=32 * (steps + 2), seq_len=512, vocab_size=8192, batch_size=32, num_workers=2
    )
    monitor = GoodputMonitor(warmup_steps=10, summary=False, plot=False, every_n_steps=10**9)
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        callbacks=[monitor],
    )
    trainer.fit(model, datamodule=dm)
    r = monitor.results
    return {
        "steps_per_sec": 1000.0 / r["throughput/step_time_ms"],
        "mfu": r.get("throughput/mfu", 0.0),
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("strategies_gpu.py needs a CUDA GPU")
    rows: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    for strategy in ("auto", "accel_zero2", "accel_fsdp"):
        if strategy == "accel_zero2" and importlib.util.find_spec("deepspeed") is None:
            errors[strategy] = "deepspeed is not installed here (carry its wheel)"
            print(f"skipping {strategy}: {errors[strategy]}")
            continue
        torch.cuda.reset_peak_memory_stats()
        try:  # one device run is all there is: a failing preset must not cost the others' numbers
            rows[strategy] = measure(strategy, args.steps)
        except Exception as err:
            errors[strategy] = f"{type(err).__name__}: {err}"
            print(f"{strategy} failed: {errors[strategy]}", file=sys.stderr)
            continue
        print(f"{strategy:>12}: {rows[strategy]['steps_per_sec']:.2f} steps/s, MFU {rows[strategy]['mfu']:.3f}")
    base = rows.get("auto", {}).get("steps_per_sec")
    ratios = {k: v["steps_per_sec"] / base for k, v in rows.items()} if base else {}
    result = {"rows": rows, "errors": errors, "ratio_vs_single_device": ratios}
    write("strategies_gpu", result, ratios, "steps/s ratio vs single device", out=args.out)
    if errors:
        raise SystemExit(f"strategies failed: {', '.join(errors)}")


if __name__ == "__main__":
    main()
