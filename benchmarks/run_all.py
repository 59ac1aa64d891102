"""Run every benchmark on this machine and print one table of ratios measured side by side.

    python -m benchmarks.run_all [--quick]      # or: make bench

Writes benchmarks/results/<name>.json and <name>.png for each, plus summary.json.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import checkpoint_async, dataloading, goodput_attribution, monitor_overhead, precision_compile
from benchmarks.harness import RESULTS, environment, write


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds (a smoke run, noisier)")
    args = p.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(2)
    q = args.quick
    headline: list[tuple[str, str, float]] = []

    r = precision_compile.run(steps=30 if q else 80)
    write("precision_compile", r, r["ratios_vs_fp32_eager"], "steps/s ratio vs fp32 eager")
    headline += [
        ("precision_compile", f"{k} / fp32 eager (steps/s)", v)
        for k, v in r["ratios_vs_fp32_eager"].items()
        if k != "fp32 eager"
    ]

    r = dataloading.run(images=128 if q else 512, rounds=1 if q else 7)
    dataloading.write("dataloading", r)
    headline += [
        ("dataloading", f"{k} / tuned torch DataLoader, same workers (images/s, median of rounds)", v)
        for k, v in r["ratio_vs_torch_median"].items()
    ]

    r = monitor_overhead.run(steps=60 if q else 200, rounds=3 if q else 7)
    write("monitor_overhead", r, r["best_step_ms"], "best ms per step (steady state)")
    headline.append(("monitor_overhead", "ours / none, best time per step (target < 1.01)", r["ratio"]))
    headline.append(("monitor_overhead", "ours / none, median time per step", r["median_ratio"]))
    headline.append(("monitor_overhead", "ours / none, whole fit incl. one-time setup", r["fit_ratio"]))
    headline.append(("monitor_overhead", "Lightning ThroughputMonitor / none, best per step", r["lightning_ratio"]))

    r = goodput_attribution.run(steps=60 if q else 200, rounds=1 if q else 3, png=RESULTS / "goodput_ledger.png")
    write("goodput_attribution", r, r["median_shares"], "share of wall time (median run)")
    headline.append(
        ("goodput_attribution", "samples/s ours / Lightning ThroughputMonitor", r["samples_per_sec_ratio_vs_lightning"])
    )

    r = checkpoint_async.run(params_m=5 if q else 25, steps=20 if q else 60, rounds=1 if q else 7)
    fit_cost = {name: v["fit_over_none"] for name, v in r["variants"].items() if name != "none"}
    write("checkpoint_async", r, fit_cost, "fit time over the fit without checkpoints")
    headline.append(
        ("checkpoint_async", "fit time, ours async / best peer (target <= 1.05)", r["ours_async_over_best_peer_fit"])
    )
    headline.append(
        ("checkpoint_async", "stall per save, ours async / torch DCP (target <= 2)", r["ours_async_stall_over_dcp"])
    )

    (RESULTS / "summary.json").write_text(
        json.dumps(
            {
                "environment": environment(),
                "quick": q,
                "ratios": [{"benchmark": b, "ratio": n, "value": v} for b, n, v in headline],
            },
            indent=2,
        )
    )
    table = Table(title=f"lightning-accel benchmarks ({environment()['device']}, torch {torch.__version__})")
    for col in ("benchmark", "ratio", "value"):
        table.add_column(col, justify="right" if col == "value" else "left")
    for bench, name, value in headline:
        table.add_row(bench, name, f"{value:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
