"""Ranks as threads: a strategy's collectives (``broadcast``, ``barrier``, ``reduce_boolean_decision``) between
threads of one process, for testing code that every rank runs without starting a process group."""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ThreadRanks"]


class ThreadRanks:
    """``size`` ranks; :meth:`run` calls ``fn(strategy, rank)`` on a thread per rank and returns each rank's result."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=30)
        self._slots: list[Any] = [None] * size

    def run(self, fn: Callable[[Any, int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def rank_main(rank: int) -> None:
            try:
                results[rank] = fn(_RankStrategy(self, rank), rank)
            except BaseException as err:  # surfaced in the test's thread
                errors.append(err)
                self._barrier.abort()

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        if errors:
            raise errors[0]
        return results

    def _exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        seen = list(self._slots)
        self._barrier.wait()  # every rank has read before the slots are reused
        return seen


class _RankStrategy:
    def __init__(self, ranks: ThreadRanks, rank: int) -> None:
        self.ranks, self.global_rank = ranks, rank

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.ranks._exchange(self.global_rank, obj)[src]

    def barrier(self, name: str | None = None) -> None:
        self.ranks._exchange(self.global_rank, None)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        votes = self.ranks._exchange(self.global_rank, bool(decision))
        return builtins.all(votes) if all else builtins.any(votes)
