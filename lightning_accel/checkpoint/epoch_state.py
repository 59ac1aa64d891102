"""The interrupted epoch's running aggregates, carried through the checkpoint so epoch-level values come out exact.

Two kinds: Lightning's running results of ``self.log(..., on_epoch=True)`` (read and merged through ``_compat``),
and the states of every torchmetrics ``Metric`` the module holds (``metric_state``, each rank its own: a metric that
syncs across ranks does so when it computes). Saved at every checkpoint; after a resume the metric states are put
back before the first batch, and the logged results are folded into the new epoch's once a batch has logged them
again, so the epoch's aggregate covers every batch of it, as in a run that was never interrupted.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import Metric

from lightning_accel._compat import merge_epoch_results, running_epoch_results

__all__ = [
    "EpochState",
    "PendingResults",
    "capture_epoch_state",
    "restore_metric_states",
    "user_metrics",
    "warn_about_unsaved_metrics",
]

log = logging.getLogger(__name__)

EpochState = dict[str, Any]


def user_metrics(module: LightningModule) -> dict[str, Metric]:
    """The module's torchmetrics metrics by name (Lightning's own result wrappers are not the module's)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, Metric) and name}


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_detached(v) for v in value]
    return value


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


def capture_epoch_state(trainer: Trainer, module: LightningModule) -> EpochState:
    """This rank's running epoch aggregates: logged results and metric states."""
    metrics: dict[str, dict[str, Any]] = {}
    for name, metric in user_metrics(module).items():
        metrics[name] = {state: _detached(value) for state, value in metric.metric_state.items()}
    return {"results": running_epoch_results(trainer), "metrics": metrics, "epoch": trainer.current_epoch}


def restore_metric_states(module: LightningModule, state: EpochState) -> None:
    """Put the saved metric states back (before the first resumed batch updates them)."""
    metrics = user_metrics(module)
    for name, states in state.get("metrics", {}).items():
        metric = metrics.get(name)
        if metric is None:
            rank_zero_warn(f"PreemptionCheckpoint: the checkpoint holds the state of metric {name!r}, which the "
                           "module no longer has; its epoch value starts over")  # fmt: skip
            continue
        for attr, value in states.items():
            setattr(metric, attr, _to(value, metric.device))


def warn_about_unsaved_metrics(module: LightningModule) -> None:
    """A metric with no registered state (``add_state``) keeps its running values where a checkpoint cannot see
    them: its epoch value after a mid-epoch resume covers the resumed batches only."""
    for name, metric in user_metrics(module).items():
        if not metric.metric_state:
            rank_zero_warn(
                f"PreemptionCheckpoint: metric {name!r} ({type(metric).__name__}) registers no state with "
                "add_state(), so its running value is not in the checkpoint: after a mid-epoch resume its epoch "
                "value covers the resumed batches only. Register its accumulators with self.add_state(...)."
            )


class PendingResults:
    """Saved logged results waiting for the resumed epoch to log the same keys again."""

    def __init__(self, saved: dict[str, dict[str, Any]]) -> None:
        self.saved = dict(saved)

    def merge(self, trainer: Trainer) -> None:
        for key in merge_epoch_results(trainer, self.saved):
            del self.saved[key]

    def warn_unmerged(self) -> None:
        if self.saved:
            rank_zero_warn(
                f"PreemptionCheckpoint: {sorted(self.saved)} were logged in the interrupted epoch before the "
                "preemption but not since the resume, so their epoch values are missing from this epoch."
            )
        self.saved = {}
