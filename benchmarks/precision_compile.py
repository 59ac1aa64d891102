"""Eager fp32 vs bf16-mixed vs torch.compile on the tiny GPT, measured side by side in one run; on a GPU with fp8
(compute capability 8.9+), also torchao fp8 (``Float8Training``, tensorwise) over bf16, eager and compiled.

python -m benchmarks.precision_compile [--steps 60] [--gpu]
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from lightning.pytorch import seed_everything

from benchmarks.harness import RESULTS, quiet_trainer, write
from lightning_accel import Float8Training, GoodputMonitor, TorchCompile
from lightning_accel.demos import SyntheticTokenDataModule, TinyGPT
from lightning_accel.float8 import fp8_hardware

CONFIGS = {  # name: (precision, compiled, fp8)
    "fp32 eager": ("32-true", False, False),
    "bf16 eager": ("bf16-mixed", False, False),
    "fp32 compiled": ("32-true", True, False),
    "bf16 compiled": ("bf16-mixed", True, False),
}
FP8_CONFIGS = {"fp8 eager": ("bf16-mixed", False, True), "fp8 compiled": ("bf16-mixed", True, True)}


def measure(precision: str, compiled: bool, steps: int, gpu: bool, size: dict, fp8: bool = False) -> dict[str, float]:
    seed_everything(0)
    model = TinyGPT(
        vocab_size=size["vocab"], seq_len=size["seq"], d_model=size["d"], n_layers=size["layers"], n_heads=size["heads"]
    )
    dm = SyntheticTokenDataModule(
        num_samples=size["batch"] * (steps + 2), seq_len=size["seq"], vocab_size=size["vocab"], batch_size=size["batch"]
    )
    monitor = GoodputMonitor(warmup_steps=min(10, steps // 3), summary=False, plot=False, every_n_steps=10**9)
    callbacks = [monitor] + ([Float8Training()] if fp8 else []) + ([TorchCompile()] if compiled else [])
    trainer = quiet_trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        precision=precision,
        max_steps=steps,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=dm)
    r = monitor.results
    return {
        "steps_per_sec": 1000.0 / r["throughput/step_time_ms"],
        "tokens_per_sec": r["throughput/tokens_per_sec"],
        "mfu": r.get("throughput/mfu", 0.0),
    }


def run(steps: int = 60, gpu: bool = False, after_each: Callable[[dict], None] | None = None) -> dict:
    """Measure every config in turn; ``after_each`` gets the result so far (a GPU run saves it each time)."""
    size = (
        dict(vocab=8192, seq=512, d=512, layers=8, heads=8, batch=32)
        if gpu
        else dict(vocab=256, seq=64, d=128, layers=2, heads=4, batch=16)
    )
    result: dict = {"rows": {}, "ratios_vs_fp32_eager": {}, "steps": steps, "model": size}
    configs = {**CONFIGS, **(FP8_CONFIGS if gpu and fp8_hardware() is None else {})}
    if gpu and fp8_hardware() is not None:
        result["fp8_skipped"] = fp8_hardware()
    for name, (precision, compiled, fp8) in configs.items():
        result["rows"][name] = row = measure(precision, compiled, steps, gpu, size, fp8)
        result["ratios_vs_fp32_eager"][name] = row["steps_per_sec"] / result["rows"]["fp32 eager"]["steps_per_sec"]
        if after_each is not None:
            after_each(result)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    args = p.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    bench = "precision_compile" + ("_gpu" if args.gpu else "")

    def save(result: dict) -> None:  # after every config: a run stopped at its time limit keeps what it measured
        write(bench, result, result["ratios_vs_fp32_eager"], "steps/s ratio vs fp32 eager", out=args.out)

    result = run(args.steps, args.gpu, after_each=save)
    for name, ratio in result["ratios_vs_fp32_eager"].items():
        print(f"{name:>14}: {result['rows'][name]['steps_per_sec']:8.2f} steps/s  x{ratio:.2f}")


if __name__ == "__main__":
    main()
