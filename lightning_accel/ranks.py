"""Per-rank values (RNG states, epoch values, stream positions): gathered from every rank when a checkpoint is written,
one picked per rank on resume."""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["current_rank", "for_rank", "gather_from_ranks"]

T = TypeVar("T")


def gather_from_ranks(value: T) -> list[T]:
    """Every rank's ``value``, in rank order (a collective: every rank must call it)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def for_rank(values: list[T], rank: int) -> T:
    """The saved value of ``rank`` (rank 0's when the checkpoint was written by fewer ranks)."""
    return values[rank] if rank < len(values) else values[0]


def current_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
