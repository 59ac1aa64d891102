"""The ledger as a PNG: one stacked bar of wall-time shares per attempt (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from lightning_accel.figures import pyplot
from lightning_accel.monitor.ledger import BUCKETS

__all__ = ["COLORS", "ledger_bars", "plot_ledger"]

COLORS = {
    "compute": "#2ca02c",
    "data": "#d62728",
    "transfer": "#ff7f0e",
    "checkpoint": "#9467bd",
    "validation": "#1f77b4",
    "compile": "#8c564b",
    "other": "#7f7f7f",
}


def ledger_bars(
    results: Mapping[str, float], carried: Mapping[str, float], whole_run: bool
) -> dict[str, dict[str, float]]:
    """The bars of a ledger plot: this attempt's seconds per bucket (the results less what earlier attempts carried),
    and, after restarts (``whole_run``), the whole run's."""
    bars = {"this attempt": {b: results[f"goodput/{b}_s"] - carried[b] for b in BUCKETS}}
    if whole_run:
        bars["whole run"] = {b: results[f"goodput/{b}_s"] for b in BUCKETS}
    return bars


def plot_ledger(bars: Mapping[str, Mapping[str, float]], path: str | Path, title: str = "Where the time went") -> Path:
    """Write a horizontal stacked bar per entry of ``bars`` (label -> seconds per bucket) to ``path``."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.7 * len(bars)))
    for row, seconds in enumerate(bars.values()):
        total = sum(seconds.values()) or 1.0
        left = 0.0
        for bucket in BUCKETS:
            share = seconds.get(bucket, 0.0) / total
            ax.barh(row, share, left=left, color=COLORS[bucket], label=bucket if row == 0 else None)
            if share >= 0.06:
                ax.text(left + share / 2, row, f"{share:.0%}", ha="center", va="center", color="white", fontsize=8)
            left += share
    ax.set_yticks(range(len(bars)), [f"{label}\n{sum(s.values()):.1f} s" for label, s in bars.items()])
    ax.set_xlim(0, 1)
    ax.invert_yaxis()  # first entry on top
    ax.set_xlabel("share of wall time")
    ax.set_title(title)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
