"""End-of-fit summary table shared by the monitoring callbacks."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from lightning_accel._compat import stop_progress_bar
from lightning_accel.monitor.accounting import THROUGHPUT_KEYS, GoodputAccounting
from lightning_accel.monitor.cost import Pricing
from lightning_accel.monitor.ledger import BUCKETS
from lightning_accel.monitor.membership import Change

__all__ = ["format_value", "goodput_rows", "print_summary", "wide_console"]

log = logging.getLogger(__name__)


def format_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def wide_console(stderr: bool = False) -> Console:
    """A rich console; 200 columns wide when it is a log file or a pipe (rich would wrap at 80, mid-word: with no
    terminal width to fit, rows stay on one line)."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=200)


def print_summary(title: str, rows: Mapping[str, object], console: Console | None = None, trainer: Any = None) -> None:
    """Print ``rows`` as a two-column rich table (on rank 0 only: callers check), below ``trainer``'s progress bar
    (its last frame drawn first). Printed once: the log gets the same values at DEBUG only, so a run's output does
    not show its summary twice."""
    if trainer is not None:
        stop_progress_bar(trainer)
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows.items():
        table.add_row(key, format_value(value))
    log.debug("%s: %s", title, ", ".join(f"{k}={format_value(v)}" for k, v in rows.items()))
    (console or wide_console()).print(table)


def goodput_rows(
    results: Mapping[str, float], accounting: GoodputAccounting, pricing: Pricing | None, changes: Sequence[Change]
) -> dict[str, object]:
    """GoodputMonitor's end-of-fit table: buckets, throughput, restarts and membership changes, stragglers, cost."""
    rows: dict[str, object] = {}
    for bucket in BUCKETS:
        rows[bucket] = f"{results[f'goodput/{bucket}_s']:.2f} s  {results[f'goodput/{bucket}_share']:6.1%}"
    rows["goodput (compute share)"] = f"{results['goodput/compute_share']:.1%}"
    for key in THROUGHPUT_KEYS:
        if key in results:
            name = key.split("/", 1)[1]
            # shares and MFU in percent, as the buckets above: not a raw fraction beside a percentage
            rows[name] = f"{results[key]:.1%}" if name.endswith("_share") or name == "mfu" else results[key]
    if accounting.restarts:
        rows["restarts"] = accounting.restarts
        rows["lost steps / seconds"] = f"{accounting.lost_steps} / {accounting.lost_s:.1f} s"
    for number, change in enumerate(changes, 1):
        rows[f"membership change {number}"] = change.describe()
    if accounting.straggler_ratio is not None:
        rows["straggler ratio (slowest rank)"] = f"{accounting.straggler_ratio:.2f} (rank {accounting.slowest_rank})"
    if "cost/total_usd" in results:
        currency = pricing.currency if pricing is not None else "USD"
        rows[f"cost ({currency}, {pricing.market if pricing else ''})"] = (
            f"{results['cost/total_usd']:.4f}, of which lost to restarts {results['cost/lost_usd']:.4f}"
        )
        for key in ("cost/usd_per_million_samples", "cost/usd_to_finish"):
            if key in results:
                rows[key.split("/", 1)[1].replace("usd", currency).replace("_", " ")] = results[key]
    return rows
