"""Throughput and utilization monitoring, logged to any Lightning logger."""

from lightning_accel.monitor.peaks import cpu_peak_flops, peak_flops
from lightning_accel.monitor.throughput import ThroughputCallback
from lightning_accel.monitor.utilization import UtilizationMonitor

__all__ = ["ThroughputCallback", "UtilizationMonitor", "cpu_peak_flops", "peak_flops"]
