"""Facts about the host this process runs on, read the same way by every module that needs them."""

from __future__ import annotations

import os

__all__ = ["usable_cores"]


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or ``taskset``'s limit, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
