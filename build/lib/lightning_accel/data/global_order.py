"""One global order per epoch in O(1) memory, and a rank's share of it computed, never listed.

The order is a keyed bijective permutation of ``[0, n)`` (a Feistel network over the next power of four, walked
back into range: Grain's index shuffle does the same), keyed by the seed and the epoch only, so every world size
sees the same order and a saved position is a point in it. A rank's slots (batches of consecutive positions, dealt
round robin from a start slot, padded or dropped as ``DistributedSampler`` pads or drops) are arithmetic on slot
numbers. So the first index of an epoch costs the same at 10^5 samples as at 10^9, and a rank holds one chunk of
its indices at a time.

Loader states record :data:`ORDER_VERSION`. A state without it was written by an earlier release, whose order was
``torch.randperm`` per epoch: :class:`EpochOrder` keeps that order (``version=1``, O(n)) so those runs resume
exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
import xxhash

__all__ = [
    "LEGACY_ORDER_VERSION",
    "ORDER_VERSION",
    "DealtSlots",
    "EpochOrder",
    "FeistelPermutation",
    "check_order_version",
    "slot_count",
    "slots_per_rank",
]

ORDER_VERSION = 2  # the keyed Feistel permutation
LEGACY_ORDER_VERSION = 1  # torch.randperm(n) seeded by seed + epoch (loader states without a version)
_ROUNDS = 6
_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's odd multipliers
_SMALL = 64  # up to this many positions (a batch), Python integers beat numpy's per-call cost


def check_order_version(version: int) -> int:
    """``version`` when this release knows that order (a loader state's ``order``); else a clear error."""
    if version not in (ORDER_VERSION, LEGACY_ORDER_VERSION):
        raise ValueError(
            f"unknown order version {version!r} in a loader state: this release knows {LEGACY_ORDER_VERSION} "
            f"and {ORDER_VERSION}. Resume with the lightning-accel release that wrote the checkpoint."
        )
    return version


def slot_count(n: int, batch_size: int, drop_last: bool) -> int:
    """Slots of ``batch_size`` in an epoch of ``n`` samples: the short last one counted unless ``drop_last``."""
    return n // batch_size if drop_last else math.ceil(n / batch_size)


def slots_per_rank(n: int, batch_size: int, replicas: int, drop_last: bool) -> int:
    """Slots each of ``replicas`` ranks is dealt in a whole epoch (:class:`DealtSlots`): the same on every rank."""
    return len(DealtSlots(n, batch_size, drop_last, 0, replicas, 0))


class FeistelPermutation:
    """A bijection of ``[0, n)`` keyed by ``(seed, epoch)``, evaluated on arrays of positions."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n = n
        self.half_bits = max(1, math.ceil(math.log2(max(n, 2)) / 2))  # the domain 4**half_bits is < 4n
        self.mask = np.uint64((1 << self.half_bits) - 1)
        self._int_keys = [xxhash.xxh64_intdigest(f"{seed}:{epoch}:{r}".encode()) for r in range(_ROUNDS)]
        self.keys = [np.uint64(key) for key in self._int_keys]

    def _round_function(self, right: np.ndarray, key: np.uint64) -> np.ndarray:
        x = (right ^ key) * _M1
        x ^= x >> np.uint64(29)
        x *= _M2
        x ^= x >> np.uint64(32)
        return x & self.mask

    def _permute_domain(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = x >> shift, x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round_function(right, key)
        return (left << shift) | right

    def _permute_one(self, x: int) -> int:
        """:meth:`_permute_domain` of one position in Python integers (numpy's per-call cost dominates a batch)."""
        half, mask, full = self.half_bits, int(self.mask), (1 << 64) - 1
        left, right = x >> half, x & mask
        for key in self._int_keys:
            f = ((right ^ key) * 0x9E3779B97F4A7C15) & full
            f ^= f >> 29
            f = (f * 0xBF58476D1CE4E5B9) & full
            f ^= f >> 32
            left, right = right, left ^ (f & mask)
        return (left << half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The sample at each position (``int64``); positions must lie in ``[0, n)``."""
        if len(positions) <= _SMALL:
            out = []
            for x in positions.tolist():
                x = self._permute_one(x)
                while x >= self.n:  # cycle walking, as below
                    x = self._permute_one(x)
                out.append(x)
            return np.array(out, dtype=np.int64)
        with np.errstate(over="ignore"):  # the multiplications wrap modulo 2**64 on purpose
            y = self._permute_domain(positions.astype(np.uint64))
            outside = y >= np.uint64(self.n)
            while outside.any():  # cycle walking: a bijection of the domain, walked back into [0, n)
                y[outside] = self._permute_domain(y[outside])
                outside = y >= np.uint64(self.n)
        return y.astype(np.int64)


class EpochOrder:
    """Epoch ``epoch``'s global order of ``n`` samples: position -> sample index.

    ``shuffle=False`` is ``0..n-1``; ``version`` :data:`ORDER_VERSION` the Feistel permutation; ``version``
    :data:`LEGACY_ORDER_VERSION` the earlier release's ``torch.randperm`` (held in memory, O(n)).
    """

    def __init__(self, n: int, seed: int, epoch: int, shuffle: bool, version: int = ORDER_VERSION) -> None:
        self.n, self.shuffle, self.version = n, shuffle, check_order_version(version)
        self._feistel = FeistelPermutation(n, seed, epoch) if shuffle and version == ORDER_VERSION else None
        self._legacy: np.ndarray | None = None
        if shuffle and version == LEGACY_ORDER_VERSION:
            self._legacy = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).numpy()

    def at(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices (``int64``) at ``positions`` of the order."""
        if self._feistel is not None:
            return self._feistel(positions)
        if self._legacy is not None:
            return self._legacy[positions]
        return positions.astype(np.int64)

    def as_list(self) -> list[int]:
        """The whole order (O(n): for inspection and tests)."""
        return self.at(np.arange(self.n, dtype=np.int64)).tolist()


class DealtSlots:
    """One rank's slots of an epoch: the order cut into slots of ``batch_size`` positions (the last one short, or
    dropped with ``drop_last``), from slot ``start`` on, dealt round robin to ``replicas`` ranks, every rank as many:
    the uneven rest dropped with ``drop_last``, else the epoch's first slots dealt again (as ``DistributedSampler``
    pads). ``fill`` makes a short last slot repeat its last sample up to ``batch_size`` (DALI's FILL).
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        drop_last: bool,
        start: int,
        replicas: int,
        rank: int,
        fill: bool = False,
    ) -> None:
        self.n, self.batch_size, self.fill = n, batch_size, fill
        self.slots = slot_count(n, batch_size, drop_last)
        rest = max(self.slots - start, 0)
        self.count = rest // replicas if drop_last else math.ceil(rest / replicas)
        self.start, self.replicas, self.rank = start, replicas, rank

    def __len__(self) -> int:
        return self.count

    def slot_ids(self, first: int, stop: int) -> np.ndarray:
        """Global slot numbers of this rank's slots ``first`` to ``stop - 1``."""
        k = np.arange(first, min(stop, self.count), dtype=np.int64)
        g = self.start + self.rank + k * self.replicas
        return np.where(g < self.slots, g, (g - self.slots) % max(self.slots, 1))

    def positions(self, first: int, stop: int) -> np.ndarray:
        """The order positions of this rank's slots ``first`` to ``stop - 1``, in order (a short slot's missing
        positions left out, or its last one repeated with ``fill``)."""
        slots = self.slot_ids(first, stop)
        grid = slots[:, None] * self.batch_size + np.arange(self.batch_size, dtype=np.int64)[None, :]
        if self.fill:
            return np.minimum(grid, self.n - 1).reshape(-1)
        return grid[grid < self.n]

    def indices(self, order: EpochOrder, chunk_slots: int = 4096) -> Iterator[int]:
        """This rank's sample indices, computed a chunk of slots at a time: one slot first (the first batch comes at
        once), then twice as many each time, up to ``chunk_slots``."""
        first, size = 0, 1
        while first < self.count:
            yield from order.at(self.positions(first, first + size)).tolist()
            first, size = first + size, min(2 * size, chunk_slots)

    def batch(self, order: EpochOrder, k: int) -> list[int]:
        """The sample indices of this rank's slot ``k``."""
        return order.at(self.positions(k, k + 1)).tolist()
