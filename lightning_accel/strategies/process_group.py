"""Close a gloo process group that is still open when the interpreter exits.

Lightning leaves the default process group open after ``fit`` (a later ``test`` in the same process
reuses it) and registers an exit hook that closes it only for NCCL. A gloo group left to interpreter
shutdown occasionally kills a finished run with SIGABRT ("terminate called without an active
exception"): gloo's worker threads release tensors while Python is being torn down (see
pytorch/pytorch#190489). This ``atexit`` hook closes it while the interpreter is still whole.

``destroy_process_group`` alone is not always enough: it only unregisters the group, and the C++
group with its threads lives on while anything still references it, such as an object caught in a
reference cycle (trainers, strategies and modules point at each other), which only the garbage
collector frees. So the hook collects too, which joins gloo's threads now rather than during
shutdown. DeepSpeed keeps its own references to the group (``deepspeed.utils.groups``): where
DeepSpeed ran, its public ``deepspeed.comm.destroy_process_group`` releases them. FSDP2 is the
exception: DTensor's sharding caches keep its device mesh, and so the group, alive, and no public
API clears them.

Nothing is registered on ``import lightning_accel``. Our strategies (``accel_ddp*``, ``accel_fsdp*``,
``accel_zero*``) register the hook when they set up their process group (it acts at exit only on gloo),
and so does the ``lightning-accel`` CLI; a program training with a stock strategy on gloo calls
:func:`close_gloo_process_group_at_exit` itself.
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from typing_extensions import override

from lightning_accel._compat import process_group_timeout
from lightning_accel.strategies.elastic import init_elastic_process_group

__all__ = [
    "AccelDDPStrategy",
    "close_gloo_process_group",
    "close_gloo_process_group_at_exit",
    "init_restart_safe_process_group",
]

log = logging.getLogger(__name__)


def close_gloo_process_group() -> bool:
    """Destroy the default process group if it is open and uses gloo, then free what still holds it.

    Returns whether there was a gloo group to close.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        return False
    deepspeed_comm = sys.modules.get("deepspeed.comm")  # only if DeepSpeed ran: never imported here for this
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        # DeepSpeed's own teardown: it destroys the group and drops the references its groups module keeps (data
        # and ZeRO parameter groups, the world group), which otherwise hold the C++ group past this hook
        deepspeed_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
    gc.collect()  # frees the cycles still holding the C++ group, so its threads are joined now
    log.debug("closed the gloo process group before interpreter exit")
    return True


def close_gloo_process_group_at_exit() -> None:
    """Register :func:`close_gloo_process_group` with ``atexit`` (idempotent: once per process)."""
    atexit.unregister(close_gloo_process_group)
    atexit.register(close_gloo_process_group)


def init_restart_safe_process_group(strategy: ParallelStrategy) -> bool:
    """Open ``strategy``'s process group on torchrun's store, namespaced by the restart attempt (see
    :mod:`lightning_accel.strategies.elastic`); a no-op outside torchrun. Lightning then uses the open group."""
    device = strategy.root_device
    backend = getattr(strategy, "process_group_backend", None) or ("nccl" if device.type == "cuda" else "gloo")
    return init_elastic_process_group(
        backend, process_group_timeout(strategy), device if device.type == "cuda" else None
    )


class AccelDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy``, plus a process group that survives torchrun's restarts and the exit hook
    above (a no-op at exit unless the group is gloo)."""

    @override
    def setup_distributed(self) -> None:
        init_restart_safe_process_group(self)
        super().setup_distributed()
        close_gloo_process_group_at_exit()
