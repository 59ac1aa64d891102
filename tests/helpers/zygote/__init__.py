"""The test session's process zygote (server.py, sitecustomize.py; see docs/architecture.md)."""

from __future__ import annotations

import os

__all__ = ["fresh_env"]


def fresh_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that must start as a fresh interpreter: a test of what a process
    imports (the zygote's has torch and Lightning in memory before the child's first line)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ACCEL_TEST_ZYGOTE")}
    return {**env, **extra}
