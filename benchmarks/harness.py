"""Shared benchmark plumbing: a quiet Trainer, and one JSON plus one bar-chart PNG per benchmark."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer

from lightning_accel.figures import pyplot
from lightning_accel.testing import quiet_trainer_kwargs

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "torch": torch.__version__,
        "device": device,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def quiet_trainer(**kwargs: Any) -> Trainer:
    """A Trainer that only trains: no logger, checkpoints, progress bar, summary or validation."""
    return Trainer(**quiet_trainer_kwargs(**kwargs))


def write_json(name: str, result: dict[str, Any], out: Path = RESULTS) -> Path:
    """Save ``result`` with the environment as ``out/name.json``; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "environment": environment(), **result}, indent=2))
    return path


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write and close a matplotlib figure."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(name: str, result: dict[str, Any], values: dict[str, float], ylabel: str, out: Path = RESULTS) -> Path:
    """Save ``result`` as ``name.json`` and a bar chart of ``values`` as ``name.png``; returns the JSON path."""
    plt = pyplot()

    path = write_json(name, result, out)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(list(values), list(values.values()), color="#4C72B0")
    ax.bar_label(bars, fmt="%.3g")
    ax.set_ylabel(ylabel)
    ax.set_title(name)
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
    save_figure(fig, out / f"{name}.png")
    return path
