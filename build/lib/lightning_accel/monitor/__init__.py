"""Monitoring: the goodput ledger with throughput and MFU, utilization, Prometheus export, the hang sentinel."""

from lightning_accel.monitor.accounting import GoodputAccounting
from lightning_accel.monitor.cost import Pricing
from lightning_accel.monitor.exporter import PrometheusExporter
from lightning_accel.monitor.goodput import GoodputMonitor
from lightning_accel.monitor.heartbeat import Beat, HangReport
from lightning_accel.monitor.idle import IdleMonitor
from lightning_accel.monitor.peaks import cpu_peak_flops, peak_flops
from lightning_accel.monitor.sentinel import HANG_EXIT_CODE, HangSentinel
from lightning_accel.monitor.utilization import UtilizationMonitor

__all__ = [
    "HANG_EXIT_CODE",
    "Beat",
    "GoodputAccounting",
    "GoodputMonitor",
    "HangReport",
    "HangSentinel",
    "IdleMonitor",
    "Pricing",
    "PrometheusExporter",
    "UtilizationMonitor",
    "cpu_peak_flops",
    "peak_flops",
]
