"""The contracts rooms rely on in each other's objects, as Protocols rather than attribute probes.

``Stateful`` is torch's own (``torch.distributed.checkpoint.stateful``): an object with ``state_dict`` and
``load_state_dict``, which is what a loader, sampler or stream must have to resume exactly. ``FollowsWorldSize`` is
ours: a loader or strategy that resumes a checkpoint written at another number of ranks (``ResumableDataLoader``,
``DALILoader`` over arrays, ``AccelDeepSpeedStrategy``) says so with ``follows_world_size = True``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["FollowsWorldSize", "Stateful", "follows_world_size", "is_stateful"]


@runtime_checkable
class FollowsWorldSize(Protocol):
    """Resumes, exactly, a checkpoint saved at another world size (PreemptionCheckpoint then re-counts the rest)."""

    follows_world_size: bool


def follows_world_size(obj: Any) -> bool:
    """Whether ``obj`` declares that it follows a change of world size."""
    return isinstance(obj, FollowsWorldSize) and bool(obj.follows_world_size)


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` (an instance or a class) is torch's ``Stateful``: ``state_dict`` and ``load_state_dict``."""
    return issubclass(obj, Stateful) if isinstance(obj, type) else isinstance(obj, Stateful)
