"""One table: which phase of a training step each Lightning profiler action times.

The goodput ledger (``monitor/``) charges wall time by it and the profiler's named ranges (``profile/``) label
traces by it; neither keeps a copy. Our own callbacks announce their work through the same profiler, under the
action names defined here (``TorchCompile``: :data:`COMPILE_ACTION`; ``TorchProfiler``: :data:`PROFILER_ACTION`).
"""

from __future__ import annotations

from typing import Literal

from lightning_accel._compat import (
    LIGHTNING_MODULE_ACTION_PREFIX,
    SAVE_CHECKPOINT_ACTION,
    STRATEGY_ACTION_PREFIX,
    TRAIN_FETCH_ACTION,
    TRAINING_BATCH_ACTION,
)

__all__ = ["COMPILE_ACTION", "PROFILER_ACTION", "Phase", "phase_of"]

COMPILE_ACTION = "torch_compile"  # around calls that compile (TorchCompile)
PROFILER_ACTION = "lightning_accel.profiler_overhead"  # the profiler's own work (trace export)

Phase = Literal[
    "data", "transfer", "step", "forward", "backward", "optimizer", "checkpoint", "compile", "profiler_overhead"
]

# Actions named exactly.
_EXACT: dict[str, Phase] = {
    TRAIN_FETCH_ACTION: "data",  # the train loader's next()
    TRAINING_BATCH_ACTION: "step",  # training step, backward and optimizer step of one micro-batch
    SAVE_CHECKPOINT_ACTION: "checkpoint",  # every trainer.save_checkpoint
    COMPILE_ACTION: "compile",
    PROFILER_ACTION: "profiler_overhead",
}
# Actions named "<prefix><class name><suffix>".
_BY_SUFFIX: tuple[tuple[str, str, Phase], ...] = (
    (STRATEGY_ACTION_PREFIX, ".batch_to_device", "transfer"),
    (STRATEGY_ACTION_PREFIX, ".training_step", "forward"),
    (STRATEGY_ACTION_PREFIX, ".backward", "backward"),
    (LIGHTNING_MODULE_ACTION_PREFIX, ".optimizer_step", "optimizer"),
)


def phase_of(action: str) -> Phase | None:
    """The phase a Lightning profiler action times, or ``None`` for the actions no phase covers."""
    phase = _EXACT.get(action)
    if phase is not None:
        return phase
    for prefix, suffix, phase in _BY_SUFFIX:
        if action.startswith(prefix) and action.endswith(suffix):
            return phase
    return None
