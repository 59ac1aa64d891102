"""Work lost to each change of membership (a node left, or one joined): measured, not guessed. No Trainer in it.

A group resumed on another number of ranks than the one that wrote its checkpoint. What that change cost, from
the checkpoint it resumed to the step the old group had reached:

- ``checkpoint_to_failure_s``: the old group's training after that checkpoint, thrown away (to its last recorded
  progress, so at most the progress interval short);
- ``restart_s``: from there to the new group training again: noticing the failure, re-rendezvous, starting the
  processes, loading the checkpoint;
- ``replay_s``: the new group training again up to the step the old one had reached (measured once, by
  ``GoodputAccounting``, which counts the same seconds as lost work, and handed over with :meth:`replayed`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MEMBERSHIP_KEYS", "Change", "MembershipLog"]

MEMBERSHIP_KEYS = ("goodput/membership_changes", "goodput/membership_lost_s", "goodput/last_change_lost_s")


@dataclass
class Change:
    """One change of world size and the seconds it cost."""

    before: int
    after: int
    step: int  # the global step the new group resumed at
    checkpoint_to_failure_s: float
    restart_s: float
    replay_s: float = 0.0

    @property
    def lost_s(self) -> float:
        return self.checkpoint_to_failure_s + self.restart_s + self.replay_s

    def describe(self) -> str:
        return (
            f"{self.before} -> {self.after} rank(s) at step {self.step}: {self.lost_s:.1f} s lost (after the "
            f"checkpoint {self.checkpoint_to_failure_s:.1f} s, restart {self.restart_s:.1f} s, replay "
            f"{self.replay_s:.1f} s)"
        )


class MembershipLog:
    """The changes of a run, carried across attempts in the checkpoint (``state_dict``)."""

    def __init__(self) -> None:
        self.changes: list[Change] = []
        self._replaying: Change | None = None  # the change whose new group is training again what was lost

    def begin(
        self, before: int, after: int, step: int, checkpoint_at: float, last_progress_at: float | None, now: float
    ) -> Change:
        """The new group is training again at ``step`` (wall clock ``now``); the checkpoint was taken at
        ``checkpoint_at`` and the old group last recorded progress at ``last_progress_at`` (wall clock, ``None``:
        unknown, all of it counts as restart)."""
        failed_at = max(checkpoint_at, last_progress_at if last_progress_at is not None else checkpoint_at)
        change = Change(before, after, step, failed_at - checkpoint_at, max(0.0, now - failed_at))
        self.changes.append(change)
        self._replaying = change
        return change

    def replayed(self, seconds: float | None) -> None:
        """The new group caught up with the old one (or its attempt ended first) after ``seconds`` of replay: what
        ``GoodputAccounting.reached``/``end_attempt`` return (``None``: no replay ended)."""
        if self._replaying is not None and seconds is not None:
            self._replaying.replay_s = seconds
            self._replaying = None

    def metrics(self) -> dict[str, float]:
        if not self.changes:
            return {}
        return {
            "goodput/membership_changes": float(len(self.changes)),
            "goodput/membership_lost_s": sum(c.lost_s for c in self.changes),
            "goodput/last_change_lost_s": self.changes[-1].lost_s,
        }

    def state_dict(self) -> list[dict[str, Any]]:
        return [asdict(change) for change in self.changes]

    def load_state_dict(self, state: list[dict[str, Any]] | None) -> None:
        self.changes = [Change(**change) for change in state or []]
        self._replaying = None
