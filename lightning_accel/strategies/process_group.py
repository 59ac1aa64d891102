"""Close a gloo process group that is still open when the interpreter exits.

Lightning leaves the default process group open after ``fit`` (a second ``fit`` or ``test`` in the
same process reuses it). Left to interpreter shutdown, gloo's background threads are torn down in
no particular order and the process occasionally dies with SIGABRT after a successful run, which
turns a green job red. An ``atexit`` hook runs before that shutdown, while everything still exists.

Only gloo is closed: NCCL's ``destroy_process_group`` may wait on collectives still in flight when
a rank exits on an error, and a hang there is worse than the abort.
"""

from __future__ import annotations

import atexit
import logging

import torch.distributed as dist

log = logging.getLogger(__name__)
_registered = False


def close_gloo_process_group() -> bool:
    """Destroy the default process group if it is open and uses gloo; return whether it did."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        return False
    dist.destroy_process_group()
    log.debug("closed the gloo process group before interpreter exit")
    return True


def close_gloo_process_group_at_exit() -> None:
    """Register :func:`close_gloo_process_group` with ``atexit`` (once per process)."""
    global _registered
    if not _registered:
        atexit.register(close_gloo_process_group)
        _registered = True
