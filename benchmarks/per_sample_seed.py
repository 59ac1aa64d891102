"""Cost of seeding each sample's random draws (PerSampleSeed), per sample, beside the same dataset unseeded.

A dataset whose __getitem__ draws noise (torch), a flip (random) and a scale (NumPy), read in alternating rounds:
plain, seeded as in a loader worker (generators seeded, not put back), seeded on the main process (generators
seeded and put back around the sample). The figure a user pays is the added microseconds per sample; a real
image pipeline's decode and augmentation take milliseconds per sample.

    python -m benchmarks.per_sample_seed [--samples 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from unittest import mock

import numpy as np
import torch
from torch.utils.data import Dataset

from benchmarks.harness import write
from lightning_accel.data import PerSampleSeed


class Augmented(Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 3, 8, 8)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.x[i] + 0.1 * torch.randn(3, 8, 8)
        if random.random() < 0.5:
            x = x.flip(-1)
        return x * float(np.random.uniform(0.9, 1.1))


def seconds_per_sample(read, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        read(i)
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain = Augmented(args.samples)
    seeded = PerSampleSeed(plain, seed=0)
    in_worker = mock.patch("lightning_accel.data.seeding.get_worker_info", return_value=object())
    variants = {
        "plain": lambda i: plain[i],
        "seeded (worker)": lambda i: seeded[(0, i)],
        "seeded (main process)": lambda i: seeded[(0, i)],
    }
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, read in variants.items():
            if name == "seeded (worker)":
                with in_worker:
                    rounds[name].append(seconds_per_sample(read, args.samples))
            else:
                rounds[name].append(seconds_per_sample(read, args.samples))
    us = {name: 1e6 * statistics.median(times) for name, times in rounds.items()}
    added = {f"{name}: added us/sample": us[name] - us["plain"] for name in us if name != "plain"}
    result = {"samples": args.samples, "rounds": args.rounds, "us_per_sample": us, **added, "all_rounds_s": rounds}
    path = write("per_sample_seed", result, us, "microseconds per sample (median of rounds)")
    print(f"{path}: {', '.join(f'{k} {v:.1f}' for k, v in us.items())} us/sample")


if __name__ == "__main__":
    main()
