"""Tuned vs untuned recipe vs the batch size Lightning's BatchSizeFinder picks, side by side (issue #14).

1. ``lightning-accel tune`` on the recipe within ``--budget`` writes ``tuned.yaml``.
2. Lightning's ``BatchSizeFinder(mode="power")`` runs on the same recipe, starting from the recipe's batch
   size. It looks for the largest batch that fits memory; on a CPU nothing stops it before the operating
   system does, so it is capped at ``--bsf-trials`` doublings (6: 64x the recipe's batch).
3. Each of the three (untuned, BatchSizeFinder's batch, tuned) is measured by the same trial runner tune
   uses (a fresh process, warm-up batches excluded, ``--measure-s`` seconds), in ``--rounds`` rounds of
   alternating order; reported are samples/s per round and the median, and the ratios of the medians.

    python -m benchmarks.tune_recipe [--config recipes/tiny_gpt_cpu.yaml] [--budget 5m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, save_figure, write_json
from lightning_accel.figures import pyplot
from lightning_accel.tuning import Candidate, TrialSettings, tune
from lightning_accel.tuning.server import run_trial


def batch_size_finder(config: str, max_trials: int) -> int:
    """The batch size Lightning's BatchSizeFinder picks for the recipe (power mode, from the recipe's batch)."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    from lightning_accel.recipe import build_cli

    with tempfile.TemporaryDirectory() as tmp:
        cli = build_cli(
            [
                "--config",
                config,
                "--trainer.max_steps",
                "1",
                "--trainer.logger",
                "false",
                "--trainer.default_root_dir",
                tmp,
                "--trainer.limit_val_batches",
                "0",
                "--trainer.val_check_interval",  # the recipe's (in steps) may exceed an epoch at a larger batch
                "1.0",
                "--trainer.enable_progress_bar",
                "false",
            ],
            run=False,
        )
        trainer = cli.trainer
        trainer.callbacks[:] = [c for c in trainer.callbacks if "Checkpoint" not in type(c).__name__]
        start = cli.datamodule.batch_size
        finder = BatchSizeFinder(mode="power", steps_per_trial=3, init_val=start, max_trials=max_trials)
        trainer.callbacks.append(finder)
        trainer.fit(cli.model, datamodule=cli.datamodule)
        return int(finder.optimal_batch_size)


def measure(
    config: str, candidate: Candidate, settings: TrialSettings, workdir: Path, as_is: bool, fork: bool = True
) -> float:
    """Samples/s of one trial of ``config`` with ``candidate`` (``fork=False`` for multi-device recipes)."""
    spec = {
        "config": config,
        "candidate": candidate.as_dict(),
        "settings": vars(settings),
        "as_is": as_is,
        "fork": fork,
    }
    result = run_trial(spec, timeout_s=600, workdir=workdir)
    if result.error:
        raise RuntimeError(f"{config} {candidate.label()}: {result.error}")
    return float(result.samples_per_sec or 0.0)


def side_by_side(
    variants: dict[str, tuple[str, Candidate, bool]], settings: TrialSettings, rounds: int, fork: bool = True
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Samples/s of each variant (config, candidate, as_is) per round, in alternating order, and their medians."""
    per_round: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            names = list(variants) if r % 2 == 0 else list(reversed(variants))
            row = {}
            for i, name in enumerate(names):
                config, candidate, as_is = variants[name]
                row[name] = measure(config, candidate, settings, Path(tmp) / f"r{r}_{i}", as_is, fork)
            per_round.append(row)
    median = {name: statistics.median(row[name] for row in per_round) for name in variants}
    return per_round, median


def run(config: str, budget: str, rounds: int, measure_s: float, bsf_trials: int, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tuned_path = out / "tune_recipe_tuned.yaml"
    tuned = tune(config, budget=budget, out=tuned_path)
    tune_s = time.perf_counter() - started
    bsf_batch = batch_size_finder(config, bsf_trials)
    settings = TrialSettings(measure_s=measure_s)
    variants = {
        "untuned": (config, Candidate(), False),
        f"BatchSizeFinder (batch {bsf_batch})": (config, Candidate(batch_size=bsf_batch), False),
        "tuned": (str(tuned_path), Candidate(), True),
    }
    per_round, median = side_by_side(variants, settings, rounds)
    bsf_name = next(n for n in variants if n.startswith("BatchSizeFinder"))
    return {
        "config": {"recipe": config, "budget": budget, "rounds": rounds, "measure_s": measure_s},
        "tune": {
            "seconds": tune_s,
            "trials": len(tuned.trials),
            "chosen": tuned.best.candidate.label(),
            "speedup_in_search": tuned.speedup,
            "noise": tuned.noise,
        },
        "batch_size_finder": {"batch": bsf_batch, "max_trials": bsf_trials},
        "median_samples_per_sec": median,
        "tuned_vs_untuned": median["tuned"] / median["untuned"],
        "tuned_vs_batch_size_finder": median["tuned"] / median[bsf_name],
        "rounds_samples_per_sec": per_round,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    median = result["median_samples_per_sec"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar(list(median), list(median.values()), color=["#999999", "#C44E52", "#55A868"])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("samples/s (median of rounds)")
    t = result["tune"]
    ax.set_title(
        f"{Path(result['config']['recipe']).name}: tuned {result['tuned_vs_untuned']:.2f}x untuned, "
        f"{result['tuned_vs_batch_size_finder']:.2f}x BatchSizeFinder\n(tune: {t['trials']} trials in "
        f"{t['seconds']:.0f}s; chosen {t['chosen']})",
        fontsize=9,
    )
    save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="recipes/tiny_gpt_cpu.yaml")
    p.add_argument("--budget", default="5m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--measure-s", type=float, default=5.0)
    p.add_argument("--bsf-trials", type=int, default=6)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    result = run(args.config, args.budget, args.rounds, args.measure_s, args.bsf_trials, args.out)
    name = "tune_recipe"
    write_json(name, result, args.out)
    plot(result, args.out / f"{name}.png")
    for variant, sps in result["median_samples_per_sec"].items():
        print(f"{variant:>32}: {sps:9.1f} samples/s")
    print(f"tuned / untuned {result['tuned_vs_untuned']:.2f}")
    print(f"tuned / BatchSizeFinder {result['tuned_vs_batch_size_finder']:.2f}")


if __name__ == "__main__":
    main()
