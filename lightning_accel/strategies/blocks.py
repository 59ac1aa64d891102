"""Which submodules of a model are its repeated blocks: the units FSDP shards and activation checkpointing wraps."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def find_block_classes(model: nn.Module, names: Sequence[str] | None = None) -> set[type[nn.Module]]:
    """Module classes to shard one by one: ``names`` if given, else the classes held in ``nn.ModuleList``s."""
    if names:
        found = {type(m) for m in model.modules() if type(m).__name__ in set(names)}
        missing = set(names) - {c.__name__ for c in found}
        if missing:
            raise ValueError(f"block_classes {sorted(missing)} do not occur in {type(model).__name__}")
        return found
    return {
        type(child)
        for m in model.modules()
        if isinstance(m, nn.ModuleList)
        for child in m
        if any(True for _ in child.parameters())
    }
