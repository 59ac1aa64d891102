"""The end-of-fit summary, Trainer-free: shares and MFU in percent like the buckets, printed once as a table that a
log file or pipe gets on whole lines (no wrap at 80 columns mid-word), the log getting the values at DEBUG only."""

from __future__ import annotations

import io
import logging

from rich.console import Console

from lightning_accel.monitor.accounting import GoodputAccounting
from lightning_accel.monitor.ledger import BUCKETS
from lightning_accel.monitor.summary import goodput_rows, print_summary, wide_console


def test_shares_are_percent_and_the_table_is_printed_once_on_whole_lines(caplog):
    results = {f"goodput/{b}_s": 1.0 for b in BUCKETS} | {f"goodput/{b}_share": 1 / len(BUCKETS) for b in BUCKETS}
    results |= {"throughput/data_wait_share": 0.005184, "throughput/mfu": 0.02678, "throughput/samples_per_sec": 77.7}
    rows = goodput_rows(results, GoodputAccounting(), None, [])
    assert rows["data_wait_share"] == "0.5%" and rows["mfu"] == "2.7%" and rows["samples_per_sec"] == 77.7
    out = io.StringIO()
    title = "lightning-accel goodput"
    with caplog.at_level(logging.INFO, logger="lightning_accel"):
        print_summary(title, {"a metric with a long name " + "y" * 60: "a value"}, Console(file=out, width=200))
    printed = out.getvalue()
    assert printed.count(title) == 1 and ("y" * 60) in printed  # one row, not wrapped mid-word
    assert not [r for r in caplog.records if title in r.getMessage()]  # not a second time in the log
    assert wide_console().width == 200  # pytest captures stdout: not a terminal
