"""`tune` on every CPU recipe of the repo, checked against issue #14's promise (issue #14, "Done when").

For each recipe: ``tune`` within ``--budget``, then the untuned and the tuned recipe measured side by side
by the trial runner tune uses (a fresh process, warm-up excluded), in ``--rounds`` rounds of alternating
order. Checked and reported per recipe:

- the search ended inside its budget;
- the chosen option is within 3% of the fastest accepted option it tried (amortized samples/s);
- the tuned recipe, measured afresh, is not slower than the untuned one: the median of the rounds' samples/s
  is at least the untuned median (unless tune kept the untuned settings, which cannot be slower).

    python -m benchmarks.tune_all_recipes [--budget 2m] [--rounds 3] [--recipes recipes/mlp_cpu.yaml ...]

The exit code is 1 when a check fails, so the run can gate a release.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, save_figure, write_json
from benchmarks.tune_recipe import side_by_side
from lightning_accel.figures import pyplot
from lightning_accel.tuning import Candidate, TrialSettings, tune

CPU_RECIPES = ("recipes/mlp_cpu.yaml", "recipes/tiny_gpt_cpu.yaml", "recipes/tiny_gpt_ddp_cpu.yaml")


def run_one(recipe: str, budget: str, rounds: int, measure_s: float, out: Path) -> dict[str, Any]:
    """Tune ``recipe``, re-measure untuned vs tuned side by side and evaluate the three checks."""
    tuned_path = out / f"{Path(recipe).stem}_tuned.yaml"
    started = time.perf_counter()
    result = tune(recipe, budget=budget, out=tuned_path)
    wall_s = time.perf_counter() - started
    fastest = max(t.amortized_sps for t in result.trials if t.accepted)
    settings = TrialSettings(measure_s=measure_s)
    # Multi-device trials re-run their command line, a new interpreter each: as tune's own trials did.
    fork = result.baseline.result.world_size == 1
    variants = {"untuned": (recipe, Candidate(), False), "tuned": (str(tuned_path), Candidate(), True)}
    per_round, median = side_by_side(variants, settings, rounds, fork)
    ratio = median["tuned"] / median["untuned"]
    checks = {
        "inside_budget": result.elapsed_s <= result.budget_s,
        "within_3pct_of_fastest": result.best.amortized_sps >= 0.97 * fastest,
        "not_slower_than_untuned": ratio >= 1.0 or result.best is result.baseline,
    }
    return {
        "recipe": recipe,
        "budget_s": result.budget_s,
        "search_s": result.elapsed_s,
        "wall_s": wall_s,
        "trials": len(result.trials),
        "chosen": result.best.candidate.label(),
        "chosen_amortized_sps": result.best.amortized_sps,
        "fastest_accepted_amortized_sps": fastest,
        "noise": result.noise,
        "median_samples_per_sec": median,
        "tuned_vs_untuned": ratio,
        "rounds_samples_per_sec": per_round,
        "checks": checks,
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    # Relative to the untuned recipe: the recipes' samples/s differ 100x, so absolute bars hide two of them.
    fig, ax = plt.subplots(figsize=(8, 3.8))
    names = [Path(r["recipe"]).stem for r in results]
    x = list(range(len(results)))
    med = [r["median_samples_per_sec"] for r in results]
    ax.bar([i - 0.2 for i in x], [1.0] * len(x), width=0.4, color="#999999", label="untuned")
    ax.bar([i + 0.2 for i in x], [r["tuned_vs_untuned"] for r in results], width=0.4, color="#55A868", label="tuned")
    for i, r in enumerate(results):  # each round's own ratio, to show the spread
        ratios = [rd["tuned"] / rd["untuned"] for rd in r["rounds_samples_per_sec"]]
        ax.scatter([i + 0.2] * len(ratios), ratios, color="black", s=10, zorder=3)
    for i, (r, m) in enumerate(zip(results, med, strict=True)):  # above the bar and its dots
        top = max([r["tuned_vs_untuned"]] + [rd["tuned"] / rd["untuned"] for rd in r["rounds_samples_per_sec"]])
        label = f"{r['tuned_vs_untuned']:.2f}x\n{m['tuned']:,.0f} vs {m['untuned']:,.0f}/s"
        ax.text(i + 0.2, top + 0.05, label, ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="#444444", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, [f"{n}\n{r['chosen']}" for n, r in zip(names, results, strict=True)], fontsize=8)
    ax.set_ylabel("samples/s relative to untuned")
    ax.set_ylim(0, max(r["tuned_vs_untuned"] for r in results) * 1.3)
    ax.set_title("tune on every CPU recipe: tuned vs untuned, median of rounds (dots: each round)", fontsize=10)
    ax.legend(loc="upper right")
    save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=list(CPU_RECIPES))
    p.add_argument("--budget", default="2m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--measure-s", type=float, default=4.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_one(r, args.budget, args.rounds, args.measure_s, args.out) for r in args.recipes]
    name = "tune_all_recipes"
    write_json(name, {"config": {"budget": args.budget, "rounds": args.rounds}, "recipes": results}, args.out)
    plot(results, args.out / f"{name}.png")
    failed = False
    for r in results:
        bad = [k for k, ok in r["checks"].items() if not ok]
        failed |= bool(bad)
        print(
            f"{r['recipe']:>32}: {r['trials']:2d} trials in {r['search_s']:5.0f}/{r['budget_s']:.0f}s, "
            f"chose {r['chosen']}, tuned/untuned {r['tuned_vs_untuned']:.2f}, "
            f"{'all checks pass' if not bad else 'FAILED: ' + ', '.join(bad)}"
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
