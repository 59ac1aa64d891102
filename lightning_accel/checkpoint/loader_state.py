"""What a checkpoint can resume exactly (which train loaders, at which world size), and the warnings that name the
fix for the rest."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.data import has_len
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_accel.contracts import follows_world_size, is_stateful

__all__ = [
    "flat_loaders",
    "has_wrapped_stateful_sampler",
    "refuse_loaders_that_cannot_follow",
    "train_batch_size",
    "warn_if_epoch_order_is_lost",
    "warn_if_not_resumable",
]


def has_wrapped_stateful_sampler(loader: Any) -> bool:
    """A StatefulDataLoader whose own sampler Lightning wrapped for DDP (its order is lost on resume)."""
    if not isinstance(loader, StatefulDataLoader):
        return False
    samplers = (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None))
    return any(isinstance(s, DistributedSamplerWrapper) for s in samplers)


def flat_loaders(loaders: Any) -> list[Any]:
    """``trainer.train_dataloader`` (one loader, a list or a dict of them) as a flat list."""
    if isinstance(loaders, dict):
        return list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return list(loaders)
    return [loaders]


def train_batch_size(loaders: Any) -> int | None:
    """The per-device batch of a fit's one train loader (``trainer.train_dataloader``); ``None`` when there are
    several loaders or the loader has no integer ``batch_size`` (a batch sampler, an iterable of batches)."""
    found = [loader for loader in flat_loaders(loaders) if loader is not None]
    size = getattr(found[0], "batch_size", None) if len(found) == 1 else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def warn_if_not_resumable(loaders: Any) -> None:
    for loader in flat_loaders(loaders):
        if loader is None:
            continue
        if has_wrapped_stateful_sampler(loader):
            rank_zero_warn(
                "PreemptionCheckpoint: under DDP, Lightning wrapped this StatefulDataLoader's own sampler in a "
                "DistributedSamplerWrapper, which reshuffles from the global RNG at every epoch and keeps no "
                "state, so the order after a resume differs from the uninterrupted run's. Build the loader in "
                "train_dataloader() with `sampler=StatefulDistributedSampler(dataset, shuffle=True, seed=...)` "
                "(from torchdata.stateful_dataloader.sampler); Lightning keeps a distributed sampler as it is."
            )
        stream = isinstance(getattr(loader, "dataset", None), IterableDataset)
        seeded = getattr(getattr(loader, "dataset", None), "seeds_per_sample", False)  # data.PerSampleSeed
        if getattr(loader, "num_workers", 0) > 0 and not seeded:
            fix = (
                "Draw a stream's random numbers from a generator seeded by the sample's own id, as "
                "docs/checkpointing.md 'Streams' shows"
                if stream
                else "Wrap the dataset in lightning_accel.data.PerSampleSeed with a sampler from tag_epochs() "
                "(ResumableDataLoader does it with workers), or augment on the GPU"
            )
            where = "the stream" if stream else "the dataset's __getitem__"
            rank_zero_warn(
                f"PreemptionCheckpoint: the train loader runs {loader.num_workers} worker processes. Their random "
                f"state is not in the checkpoint: if {where} draws random numbers (augmentation), "
                "the samples trained after a mid-epoch resume get other random draws than in an uninterrupted run "
                f"(the sample order is still exact). {fix} (docs/checkpointing.md, 'Augmentation in loader workers')."
            )
        read_ahead_lost = not getattr(loader, "accounts_for_read_ahead", False)  # data.ResumableStreamLoader
        if stream and isinstance(loader, StatefulDataLoader) and not has_len(loader) and read_ahead_lost:
            rank_zero_warn(
                "PreemptionCheckpoint: Lightning reads one batch ahead of a loader without a length, and "
                "StatefulDataLoader saves its stream's state with that batch already taken: a resume skips one batch. "
                "Use lightning_accel.ResumableStreamLoader (a StatefulDataLoader that saves the state from before "
                "the read-ahead), or give the stream a __len__."
            )
        if not is_stateful(loader):
            fix = (
                "lightning_accel.ResumableStreamLoader over a stream with state_dict()/load_state_dict()"
                if stream
                else "`from torchdata.stateful_dataloader import StatefulDataLoader` (same arguments as DataLoader) "
                "or lightning_accel.ResumableDataLoader"
            )
            rank_zero_warn(
                f"PreemptionCheckpoint: the train loader ({type(loader).__name__}) has no state_dict, so a "
                f"resume from a mid-epoch checkpoint replays or skips samples and is not exact. Use {fix}."
            )


def refuse_loaders_that_cannot_follow(loaders: Any, change: Any) -> None:
    """On a resume at another world size (``change``, a ``WorldChange``): every train loader must be able to go on
    from the saved point of a global order (``follows_world_size``, as ``ResumableDataLoader`` does). A map-style
    loader that saved a per-rank position is refused; a stream, whose shards are its own, is warned about."""
    for loader in flat_loaders(loaders):
        if loader is None or follows_world_size(loader):
            continue
        if isinstance(getattr(loader, "dataset", None), IterableDataset):
            rank_zero_warn(
                f"PreemptionCheckpoint: resuming on another number of ranks ({change}) with a stream: each rank's "
                "stream position is its own, so ranks that are new take rank 0's and the rest of the epoch repeats or "
                "skips samples. Use a map-style dataset in lightning_accel.ResumableDataLoader for an exact resume."
            )
            continue
        # A loader that knows why it cannot follow says so (DALILoader over a file reader); else the general fix.
        fix = getattr(loader, "world_change_fix", None) or (
            "Use lightning_accel.ResumableDataLoader (same arguments as DataLoader; its position is a point in one "
            "global order), or"
        )
        sampler = getattr(loader, "sampler", None)
        named = type(loader).__name__ + (f" over {type(sampler).__name__}" if sampler is not None else "")
        raise RuntimeError(
            f"PreemptionCheckpoint: resuming on another number of ranks ({change}), but the train loader "
            f"({named}) saved each rank's "
            "position in its own share of the data, which does not map onto another split: the rest of the epoch "
            f"would repeat or skip samples. {fix} resume on {change.saved_world_size} rank(s) "
            "(docs/checkpointing.md, 'Another world size')."
        )


def warn_if_epoch_order_is_lost(loaders: Any, epoch: int) -> None:
    """On a resume in epoch ``epoch`` > 0: a StatefulDataLoader with workers over a StatefulDistributedSampler whose
    state has no epoch (torchdata's own) shuffles the rest of the epoch in epoch 0's order, since its workers take
    their first indices before Lightning calls set_epoch."""
    if epoch == 0:
        return
    for loader in flat_loaders(loaders):
        sampler = getattr(loader, "sampler", None)
        if (
            isinstance(loader, StatefulDataLoader)
            and getattr(loader, "num_workers", 0) > 0
            and isinstance(sampler, StatefulDistributedSampler)
            and not getattr(sampler, "epoch_tagged", False)
        ):
            rank_zero_warn(
                f"PreemptionCheckpoint: resuming in epoch {epoch}, this StatefulDataLoader's workers take their first "
                "indices before Lightning sets the sampler's epoch, and StatefulDistributedSampler does not save its "
                "epoch: the rest of the epoch comes in epoch 0's order. Pass the sampler through "
                "lightning_accel.data.tag_epochs() (its state then carries the epoch; pair it with PerSampleSeed), "
                "or use lightning_accel.ResumableDataLoader."
            )
