"""End-of-fit summary table shared by the monitoring callbacks."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from rich.console import Console
from rich.table import Table

log = logging.getLogger(__name__)


def format_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def print_summary(title: str, rows: Mapping[str, object], console: Console | None = None) -> None:
    """Log ``rows`` and print them as a two-column rich table (on rank 0 only: callers check)."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows.items():
        table.add_row(key, format_value(value))
    log.info("%s: %s", title, ", ".join(f"{k}={format_value(v)}" for k, v in rows.items()))
    (console or Console()).print(table)
