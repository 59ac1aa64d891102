"""Capture and restore every random generator a training step draws from (Python, NumPy, torch, CUDA)."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

from lightning_accel.ranks import gather_from_ranks

__all__ = ["RNGState", "capture_rng", "gather_rng_states", "restore_rng", "rng_for_rank", "seeded_rng"]

RNGState = dict[str, Any]


def capture_rng() -> RNGState:
    """This process's generator states, as tensors and plain values (checkpoints load with ``weights_only=True``).

    Python's and NumPy's Mersenne Twister keys (625 integers each) are kept as one tensor each, not a tuple of
    ints: an asynchronous save walks the checkpoint on the training thread to snapshot its tensors, and 625
    leaves cost it about 20 ms a save where one tensor costs microseconds."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    version, internal, python_gauss = random.getstate()
    python_state = (version, torch.tensor(internal, dtype=torch.int64), python_gauss)
    state: RNGState = {"python": python_state, "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: RNGState) -> None:
    version, internal, python_gauss = state["python"]
    if isinstance(internal, torch.Tensor):  # (checkpoints written before it was a tensor hold the tuple itself)
        internal = tuple(internal.tolist())
    random.setstate((version, internal, python_gauss))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng_states() -> list[RNGState]:
    """Every rank's generator states, in rank order (a collective: every rank must call it)."""
    return gather_from_ranks(capture_rng())


def rng_for_rank(states: list[RNGState], rank: int) -> RNGState:
    """The generator states ``rank`` resumes with: its own when the checkpoint has them, else states derived from rank
    0's and ``rank`` (a rank that joined: the same on every resume of that checkpoint, and not another rank's)."""
    if rank < len(states):
        return states[rank]
    root = states[0]["torch"].numpy().tobytes() + rank.to_bytes(8, "little")
    return seeded_rng(int.from_bytes(hashlib.blake2b(root, digest_size=8).digest(), "little") >> 1)


def seeded_rng(seed: int) -> RNGState:
    """The states every generator has after being seeded with ``seed`` (this process's own are left as they were)."""
    saved = capture_rng()
    try:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        return capture_rng()
    finally:
        restore_rng(saved)
