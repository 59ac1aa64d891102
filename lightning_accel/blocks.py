"""Which submodules of a model are its repeated blocks: the units FSDP shards and activation checkpointing wraps."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["children_beside_blocks", "find_block_classes", "find_blocks"]


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


def children_beside_blocks(model: nn.Module, blocks: set[type[nn.Module]]) -> list[nn.Module]:
    """The model's direct children to shard as units of their own, beside its blocks.

    FSDP2 gathers a unit's parameters in hooks around that module's ``forward``. The root's run only when something
    calls the LightningModule itself; a ``training_step`` that calls ``self.net(x)`` instead would meet sharded
    parameters there. So each direct child that is called as a module and holds parameters outside the blocks gets
    its own hooks. Left to the root: containers (``ModuleList``/``ModuleDict``, never called themselves) and children
    sharing a parameter with another child (tied weights must stay in one unit).
    """
    in_blocks = {id(p) for m in model.modules() if isinstance(m, tuple(blocks)) for p in m.parameters()}
    owners: dict[int, int] = {}
    for child in model.children():
        for p in child.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    chosen = []
    for child in model.children():
        params = [p for p in child.parameters() if id(p) not in in_blocks]
        if isinstance(child, (nn.ModuleList, nn.ModuleDict, *blocks)) or not params:
            continue
        if all(owners[id(p)] == 1 for p in child.parameters()):
            chosen.append(child)
    return chosen


def find_blocks(model: nn.Module, names: Sequence[str] | None = None) -> list[nn.Module]:
    """The block instances themselves: every instance of the classes named, or, found automatically, the children
    of the model's ``nn.ModuleList``s only. (By class alone, blocks that are ``nn.Sequential``s would take every
    ``nn.Sequential`` with them, a head beside the blocks included.)"""
    if names:
        classes = tuple(find_block_classes(model, names))
        return [m for m in model.modules() if isinstance(m, classes)]
    return [
        child
        for m in model.modules()
        if isinstance(m, nn.ModuleList)
        for child in m
        if any(True for _ in child.parameters())
    ]
