"""Deprecated home of ``ThroughputCallback``: it is :class:`GoodputMonitor` now."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from lightning_accel.monitor.goodput import GoodputMonitor


class ThroughputCallback(GoodputMonitor):
    """Deprecated alias of :class:`GoodputMonitor` (removed in 0.3).

    ``log_every_n_steps`` now counts optimizer steps, as everywhere else; ``window`` is gone (rates are over
    each logging interval). Its old ``data_wait_share`` counted every gap between batches (checkpoint saves
    and other callbacks included); the new one is the train loader's ``next()`` only.
    """

    def __init__(
        self,
        log_every_n_steps: int = 10,
        window: int | None = None,
        warmup_steps: int = 2,
        batch_size_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], int | None] | None = None,
        flops_per_batch: float | None = None,
        data_wait_warn: float = 0.10,
        summary: bool = True,
    ) -> None:
        warnings.warn(
            "ThroughputCallback is deprecated: use lightning_accel.GoodputMonitor(every_n_steps=...) "
            "(log_every_n_steps now counts optimizer steps; window= is gone)",
            FutureWarning,
            stacklevel=2,
        )
        super().__init__(
            every_n_steps=log_every_n_steps,
            warmup_steps=warmup_steps,
            batch_size_fn=batch_size_fn,
            tokens_fn=tokens_fn,
            flops_per_batch=flops_per_batch,
            data_wait_warn=data_wait_warn,
            summary=summary,
            plot=False,
        )
