"""Whether loader workers can hand their batches to the training process, checked before they are started.

With torch's default sharing strategy on Linux (``file_descriptor``) a worker sends each batch's tensors as file
descriptors, through a Unix socket that Python's ``multiprocessing`` binds in its folder under the temporary one
(``$TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX``; a worker uses its parent's ``pymp-`` folder). A socket's path may have
at most 107 bytes. Under a longer ``TMPDIR`` (a deep job folder of a batch scheduler, a test's own folder) the bind
fails in the worker's queue thread, which prints ``OSError: AF_UNIX path too long`` and drops the batch, and the
training process waits for it forever: the first batch never comes (Python 3.11; found as this project's flaky
HangSentinel tests, whose jobs ran under pytest's folders once their number reached ``pytest-100``).
"""

from __future__ import annotations

import multiprocessing.util
import os
from typing import Any

import torch.multiprocessing

__all__ = ["SOCKET_PATH_MAX", "check_loaders", "check_worker_handoff"]

SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path on Linux (sun_path is 108, with its terminating NUL)
_SOCKET_NAME = len("/listener-XXXXXXXX")  # what the listener adds to multiprocessing's folder


def check_worker_handoff(loader: str, num_workers: int) -> None:
    """Raise a clear ``RuntimeError`` (naming the folder and the fixes) when ``loader``'s ``num_workers`` workers
    could not hand a batch over, instead of the silent wait for a first batch that never comes."""
    if num_workers <= 0 or torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    # the folder the workers will use: this process's, which they inherit (made now under TMPDIR if it has none yet,
    # and removed at exit by multiprocessing, as when a worker makes it)
    folder = multiprocessing.util.get_temp_dir()
    longest = len(os.fsencode(folder)) + _SOCKET_NAME
    if longest > SOCKET_PATH_MAX:
        raise RuntimeError(
            f"{loader}: its {num_workers} worker(s) would hand batches over through a Unix socket in the temporary "
            f"folder {folder!r} (under TMPDIR), a path of {longest} bytes where a socket's may have {SOCKET_PATH_MAX}: "
            "the first batch would never arrive (the worker's queue thread fails with 'AF_UNIX path too long'). Set "
            "TMPDIR to a shorter folder (such as /tmp), or call "
            "torch.multiprocessing.set_sharing_strategy('file_system') before training"
        )


def check_loaders(loaders: Any) -> None:
    """:func:`check_worker_handoff` for every loader in ``loaders``: one, or a dict, list or tuple of them, as
    Lightning's ``trainer.train_dataloader`` gives them (anything with an integer ``num_workers`` counts)."""
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        for loader in loaders:
            check_loaders(loader)
    elif isinstance(getattr(loaders, "num_workers", None), int):
        check_worker_handoff(type(loaders).__name__, loaders.num_workers)
