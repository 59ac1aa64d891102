"""The hang sentinel's board for a fleet: a node's ranks meet in a folder on the node, and only the node's leader
talks to the job's store, so a poll costs the store O(nodes), not O(ranks).

Each rank writes its beat to a file in the node's folder. The leader (the node's lowest local rank, or the next one
once it goes silent) gathers the node's beats into one store key per node, reads the judge's verdict from the store
and copies it into the folder, where the node's other ranks read it. With 8 ranks a node, a 4,096-rank job's store
serves 512 nodes' keys a poll instead of 4,096 ranks' (``benchmarks/scale.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from lightning_accel.monitor.heartbeat import Beat, StoreBoard

__all__ = ["NodeBoard", "node_folder"]

_VERDICT_FILE = "verdict.json"


def node_folder(root: Path, job: str, node: int) -> Path:
    """The folder node ``node`` of job ``job`` meets in (under ``root``, a node-local folder such as /tmp)."""
    return root / f"lightning_accel-sentinel-{job}" / f"node{node}"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(path)}")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not written yet (or being replaced on a filesystem without atomic rename)


class NodeBoard:
    """A :class:`~lightning_accel.monitor.heartbeat.Board` for one rank, aggregated per node.

    Args:
        store: The job's c10d store.
        prefix: Keys under this prefix (unique to the job's attempt and fit).
        folder: The node's meeting folder (:func:`node_folder`), the same for the node's ranks.
        rank: This rank's global rank.
        node: This rank's node index; ``nodes`` the job's number of nodes.
        local_rank: This rank's index on its node; ``local_world`` the node's number of ranks.
        lead_takeover_s: A leader silent this long per local rank between it and this one is replaced by this one
            (keep it under the judge's takeover time over ``local_world``, so a node changes leader before the
            job changes judge).
        verdict_every_s: How often the leader reads the verdict from the store (0: every poll). A read is the
            store's costliest operation (a request and an answer, where a beat is a one-way write); the node's
            ranks see the leader's copy each poll, so this only delays a hang found elsewhere by up to this long.
    """

    def __init__(
        self,
        store: Any,
        prefix: str,
        folder: Path,
        rank: int,
        node: int,
        nodes: int,
        local_rank: int,
        local_world: int,
        lead_takeover_s: float,
        verdict_every_s: float = 0.0,
        clock: Any = time.monotonic,
    ) -> None:
        self.job = StoreBoard(store, nodes * local_world, prefix)  # the store's keys: the nodes', the verdict's
        self.folder = folder
        self.rank, self.node, self.nodes = rank, node, nodes
        self.local_rank, self.local_world = local_rank, local_world
        self.lead_takeover_s, self.verdict_every_s, self.clock = lead_takeover_s, verdict_every_s, clock
        self._verdict: str | None = None  # the last verdict read from the store
        self._verdict_read_at = -float("inf")
        self.leader = 0  # the local rank that talks to the store for this node
        self._lead_tick = 0
        self._heard: tuple[tuple[int, int] | None, float] = (None, clock())  # the leader's (rank, tick), when seen
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def leading(self) -> bool:
        return self.leader == self.local_rank

    # -- beats ---------------------------------------------------------------------------------------------------
    def publish(self, beat: Beat) -> None:
        _write_atomically(self.folder / f"beat-{self.local_rank}.json", beat.to_json())
        self._follow_leader()
        if self.leading:  # the node's beats, one key
            beats = [_read_json(self.folder / f"beat-{r}.json") for r in range(self.local_world)]
            self.job.put(f"node/{self.node}", json.dumps([b for b in beats if b is not None]))

    def read(self) -> dict[int, Beat]:
        """Every node's beats (the judge's read: one round trip for all nodes once each has published)."""
        nodes = self.job.values([f"node/{n}" for n in range(self.nodes)])
        beats = [Beat(**b) for value in nodes for b in json.loads(value)]
        return {b.rank: b for b in beats}

    # -- the verdict ---------------------------------------------------------------------------------------------
    def _follow_leader(self) -> None:
        """Take the node's lead when its leader has gone silent long enough (the next local rank first)."""
        if self.leading:
            return
        shared = _read_json(self.folder / _VERDICT_FILE)
        now = self.clock()
        if isinstance(shared, dict):
            self.leader = int(shared.get("leader", self.leader))
            seen = (self.leader, int(shared.get("tick", 0)))
            if seen != self._heard[0]:
                self._heard = (seen, now)
        if self.leading:
            return
        if now - self._heard[1] > ((self.local_rank - self.leader) % self.local_world) * self.lead_takeover_s:
            self.leader = self.local_rank  # claimed in the folder at once, so the silent leader steps down if it wakes
            self._share(shared.get("verdict") if isinstance(shared, dict) else None)

    def _share(self, verdict: str | None) -> None:
        self._lead_tick += 1
        shared = {"leader": self.local_rank, "tick": self._lead_tick, "verdict": verdict}
        _write_atomically(self.folder / _VERDICT_FILE, json.dumps(shared))

    def read_verdict(self) -> str | None:
        """The judge's verdict: from the store for the leader, which copies it into the node's folder with a tick of
        its own; from the folder for the node's other ranks. A leader that finds another one's copy steps down."""
        path = self.folder / _VERDICT_FILE
        if not self.leading:
            shared = _read_json(path)
            return shared.get("verdict") if isinstance(shared, dict) else None
        shared = _read_json(path)
        if isinstance(shared, dict) and shared.get("leader") not in (None, self.local_rank):
            self.leader, self._heard = (
                int(shared["leader"]),
                ((int(shared["leader"]), shared.get("tick", 0)), self.clock()),
            )
            return shared.get("verdict")  # another rank took the lead while this one was silent: it keeps it
        now = self.clock()
        if now - self._verdict_read_at >= self.verdict_every_s and (verdict := self.job.read_verdict()) is not None:
            self._verdict, self._verdict_read_at = verdict, now  # (until the judge posts one: checked every poll)
        self._share(self._verdict)  # every poll, so the node's ranks see the leader alive
        return self._verdict

    def swap_verdict(self, expected: str, desired: str) -> str:
        """The judge's post (compare-and-set); the judge leading its node also shares the outcome with the node."""
        current = self.job.swap_verdict(expected, desired)
        if self.leading:
            self._share(current)
        return current

    # -- after a hang --------------------------------------------------------------------------------------------
    def mark_dumped(self, rank: int) -> None:
        self.job.mark_dumped(rank)

    def all_dumped(self) -> bool:
        return self.job.all_dumped()

    # -- the end of the fit --------------------------------------------------------------------------------------
    def leave(self) -> None:
        """This rank has published its last beat. The node's last rank to leave removes the node's folder (and the
        job's, once no other node of the job meets on this machine): a fleet's nodes run fit after fit and restart
        after restart, each in a folder of its own. Each rank marks itself gone before it looks, so the last to mark
        sees every mark. Its beat file stays until then: the node's leader keeps sending it to the store, where the
        ranks still training read that it finished. A rank that exits on a hang (76) never leaves, so a hung attempt's
        folder stays, with its last beats."""
        (self.folder / f"left-{self.local_rank}").touch()
        if all((self.folder / f"left-{r}").exists() for r in range(self.local_world)):
            shutil.rmtree(self.folder, ignore_errors=True)  # (two ranks may both see every mark)
            with contextlib.suppress(OSError):
                self.folder.parent.rmdir()  # fails while another node of the job still meets here
