"""Process groups that survive torchrun's restarts.

Under torchrun the workers' process group is built on the agent's TCPStore (``TORCHELASTIC_USE_AGENT_STORE``),
and that store outlives a restart: torch's env:// rendezvous adds no per-attempt prefix, assuming a new store
per round, which the agent does not make. So after a worker dies and torchrun restarts the group, the keys of
the dead attempt are still there: the first restarted rank to look reads a dead peer's gloo address, fails to
connect ("connectFullMesh failed ... Connection refused") and fails the attempt, or the ranks wait for each
other on mismatched keys for good (tests/launch/test_elastic.py kills and restarts a group to check this).

:func:`init_elastic_process_group` opens the group itself before Lightning does, on the same agent store under a
prefix naming the attempt (``TORCHELASTIC_RESTART_COUNT``), so each attempt starts from an empty namespace.
Lightning then finds the group initialized and uses it as is.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch.distributed as dist

__all__ = ["attempt_prefix", "init_elastic_process_group", "nodes_in_this_round", "under_torchrun"]

log = logging.getLogger(__name__)


def under_torchrun() -> bool:
    """Whether this process is a torchrun worker whose group uses the agent's store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RESTART_COUNT" in os.environ


def attempt_prefix() -> str:
    """The store namespace of this restart attempt and rendezvous round.

    A failure raises ``TORCHELASTIC_RESTART_COUNT``; a node joining an elastic job restarts the workers without
    raising it, at a larger world size, and a node leaving is a failure: so the two together name the round.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    restart, world = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ.get("WORLD_SIZE", "1")
    return f"lightning_accel/{run_id}/attempt_{restart}_world_{world}"


def init_elastic_process_group(backend: str, timeout: timedelta, device_id: object = None) -> bool:
    """Under torchrun, open the default process group on the agent's store, namespaced by the restart attempt.

    Returns whether it did (``False``: not under torchrun, or a group is already open). ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are torchrun's; ``timeout`` bounds every wait in the
    store and the group's collectives.
    """
    if not under_torchrun() or not dist.is_available() or dist.is_initialized():
        return False
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=world_size,
        is_master=False,  # the agent hosts it
        timeout=timeout,
    )
    prefix = attempt_prefix()
    kwargs = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(
        backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size, timeout=timeout, **kwargs
    )
    log.info("process group %s (rank %d of %d) on torchrun's store under %s", backend, rank, world_size, prefix)
    return True


def nodes_in_this_round() -> int | None:
    """Under torchrun: the nodes of the current rendezvous round (``WORLD_SIZE // LOCAL_WORLD_SIZE``), which an
    elastic job (``--nnodes 1:4``) changes from round to round; ``None`` outside torchrun."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" not in os.environ or not world or not local or int(world) % int(local):
        return None
    return int(world) // int(local)
