"""Matplotlib for the PNGs we write (ledger, doctor, tune): headless, imported only when a figure is drawn."""

from __future__ import annotations

from typing import Any

__all__ = ["pyplot"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display on a training node)."""
    import matplotlib  # lazy: slow to import, and only a run's end draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
