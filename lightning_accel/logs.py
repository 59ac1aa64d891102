"""Where the suite's log lines go: to the user without any logging setup, as Lightning's do.

Lightning gives its logger a handler of its own at INFO when the program configured no logging, so its key lines
(the precision, "GPU available") reach a plain script. ``lightning_accel`` does the same: why a precision was chosen,
"preempted: saved ..., exiting with code 75", an upload's margin. A program that configures logging itself (our CLI,
a trial process, a test) calls :func:`defer_to_root`, and the lines go through its handlers and levels instead.
"""

from __future__ import annotations

import logging

__all__ = ["LOGGER_NAME", "defer_to_root", "show_without_setup"]

LOGGER_NAME = "lightning_accel"


def show_without_setup() -> None:
    """INFO and above to stderr when the root logger has no handler (as ``lightning.pytorch`` does on import)."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not logger.handlers:
        logger.addHandler(logging.StreamHandler())
        logger.propagate = False


def defer_to_root() -> None:
    """Undo :func:`show_without_setup`: the root logger's handlers and level decide (call after configuring it)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
