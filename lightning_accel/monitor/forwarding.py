"""Profilers that sit in front of the user's for one fit, forward everything to it, and are taken out at the end.

The goodput ledger (:class:`LedgerProfiler`) and the phase ranges (``profile.PhaseRanges``) both ride on
Lightning's profiler calls; a user's ``Trainer(profiler="simple")`` still sees every action.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.profilers import Profiler
from typing_extensions import override

__all__ = ["ForwardingProfiler", "remove_wrapper"]


def remove_wrapper(trainer: Any, wrapper: Profiler) -> None:
    """Take ``wrapper`` (a profiler forwarding to ``.inner``) out of ``trainer.profiler``'s chain, wherever it sits.

    Callbacks that wrap the profiler for one fit (``GoodputMonitor``, ``TorchProfiler``) tear down in any order.
    """
    node, parent = trainer.profiler, None
    while node is not None and node is not wrapper:
        parent, node = node, node.__dict__.get("inner")
    if node is None:
        return
    if parent is None:
        trainer.profiler = wrapper.inner  # type: ignore[attr-defined]
    else:
        parent.inner = wrapper.inner  # type: ignore[attr-defined]


class ForwardingProfiler(Profiler):
    """A profiler in front of ``inner`` (the user's, or another wrapper) that forwards all of it; subclasses add
    their work in ``start`` / ``stop``. Installed for one fit and taken out with :func:`remove_wrapper`."""

    def __init__(self, inner: Profiler) -> None:
        super().__init__()
        self.inner = inner

    @override
    def start(self, action_name: str) -> None:
        self.inner.start(action_name)

    @override
    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)

    @override
    def setup(self, *args: Any, **kwargs: Any) -> None:
        self.inner.setup(*args, **kwargs)

    @override
    def teardown(self, *args: Any, **kwargs: Any) -> None:
        self.inner.teardown(*args, **kwargs)

    @override
    def describe(self) -> None:
        self.inner.describe()

    @override
    def summary(self) -> str:
        return self.inner.summary()

    def __getattr__(self, name: str) -> Any:  # attributes of the user's profiler (its own extras)
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
