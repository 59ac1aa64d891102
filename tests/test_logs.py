"""Our key lines reach a program that configured no logging, as Lightning's do; a program that configures logging
gets them through its own handlers and level instead (lightning_accel/logs.py)."""

from __future__ import annotations

import io
import logging

from lightning_accel.logs import LOGGER_NAME, defer_to_root, show_without_setup


def test_lines_reach_a_plain_script_and_a_configured_program_decides_itself():
    root, ours = logging.getLogger(), logging.getLogger(LOGGER_NAME)
    saved, level = list(root.handlers), root.level
    for handler in saved:  # a plain script: nothing configured (pytest's own handlers set aside for this test)
        root.removeHandler(handler)
    try:
        show_without_setup()
        (handler,) = ours.handlers
        handler.setStream(io.StringIO())
        logging.getLogger(f"{LOGGER_NAME}.precision").info("lightning_accel precision: 32-true")
        logging.getLogger(f"{LOGGER_NAME}.precision").debug("not at INFO")
        assert handler.stream.getvalue() == "lightning_accel precision: 32-true\n" and not ours.propagate
        show_without_setup()  # a second import (a reload): still one handler
        assert len(ours.handlers) == 1
        defer_to_root()  # the program configures logging: root's handlers and level decide
        configured = io.StringIO()
        root.addHandler(logging.StreamHandler(configured))
        root.setLevel(logging.WARNING)
        logging.getLogger(f"{LOGGER_NAME}.precision").info("quiet under WARNING")
        logging.getLogger(f"{LOGGER_NAME}.precision").warning("shown once")
        assert ours.handlers == [] and configured.getvalue() == "shown once\n"
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved:
            root.addHandler(handler)
        root.setLevel(level)
        defer_to_root()
