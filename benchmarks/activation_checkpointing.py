"""Activation checkpointing on the CPU: memory saved against step time paid, side by side.

A stack of transformer-style MLP blocks (LayerNorm, 4x up-projection, GELU, Dropout, residual) over a batch of token
vectors, trained without checkpointing, with ``ActivationCheckpointing("full")`` and with ``"selective"``. Each
variant runs in its own process (its peak resident memory is then its own), in alternating rounds; reported: the
median step time and the peak RSS growth over the model's own footprint, as ratios to no checkpointing.

    python -m benchmarks.activation_checkpointing [--rounds 3] [--steps 12] [--gpu] [--out DIR]

On a GPU (``--gpu``, run by benchmarks/gpu_check.sh) the memory is CUDA's peak allocation over the model's own.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.harness import RESULTS, save_figure, write_json
from lightning_accel.strategies import checkpoint_blocks, find_block_classes

VARIANTS = ("none", "full", "selective")
WIDTH, DEPTH, TOKENS = 512, 8, 4096


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def one_variant(variant: str, steps: int, gpu: bool = False) -> dict[str, float]:
    """Train ``steps`` steps in this process; its step times and peak memory growth (RSS, or CUDA's on a GPU)."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    device = torch.device("cuda" if gpu else "cpu")
    model = Stack().to(device)
    if variant != "none":
        checkpoint_blocks(model, find_block_classes(model), variant)  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(TOKENS * (8 if gpu else 1), WIDTH, device=device)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    if gpu:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_s": statistics.median(times[2:]), "peak_growth_mb": (peak - base) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--gpu", action="store_true", help="on the first CUDA device (CUDA's peak allocation)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one run, in a child process
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one_variant(args.variant, args.steps, args.gpu)))
        return
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        for variant in VARIANTS[round_ % 3 :] + VARIANTS[: round_ % 3]:  # a rotating order
            cmd = [sys.executable, "-m", "benchmarks.activation_checkpointing", "--variant", variant]
            cmd += ["--gpu"] if args.gpu else []
            out = subprocess.run([*cmd, "--steps", str(args.steps)], capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    step = {v: statistics.median(r["step_s"] for r in runs[v]) for v in VARIANTS}
    memory = {v: statistics.median(r["peak_growth_mb"] for r in runs[v]) for v in VARIANTS}
    result = {
        "device": "cuda" if args.gpu else "cpu",
        "model": {"width": WIDTH, "depth": DEPTH, "tokens": TOKENS * (8 if args.gpu else 1)},
        "step_s": step,
        "peak_growth_mb": memory,
        "step_time_ratio": {v: step[v] / step["none"] for v in VARIANTS},
        "memory_ratio": {v: memory[v] / memory["none"] for v in VARIANTS},
        "runs": runs,
    }
    name = "activation_checkpointing" + ("_gpu" if args.gpu else "")
    path = write_json(name, result, args.out)
    plot(result, args.out / f"{name}.png")
    print(f"{path}: " + ", ".join(f"{v}: {step[v] * 1e3:.0f} ms/step, +{memory[v]:.0f} MB peak" for v in VARIANTS))


def plot(result: dict, path: Path) -> None:
    from lightning_accel.figures import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, label in (
        (left, "step_time_ratio", "step time / none"),
        (right, "memory_ratio", "peak memory / none"),
    ):
        bars = ax.bar(list(result[key]), list(result[key].values()), color=["#4C72B0", "#DD8452", "#55A868"])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_ylabel(label)
    fig.suptitle(f"activation checkpointing on the {result['device'].upper()}")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
