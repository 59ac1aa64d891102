"""GPU traces read by HolisticTraceAnalysis (Meta's analyzer for torch.profiler traces): GPU idle, compute and
non-compute time per rank and time per kernel type. An optional extra: ``pip install 'lightning-accel[profile]'``.

CPU-only traces have no kernels for it to read; there the doctor uses torch.profiler's own aggregates.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning_accel.extras import pip_install

__all__ = ["hta_breakdown"]

log = logging.getLogger(__name__)


def hta_breakdown(trace_dir: str | Path) -> dict[str, Any] | None:
    """Temporal and kernel-type breakdown of the traces in ``trace_dir`` (rank 0's numbers), or ``None``.

    ``None`` (with the reason logged) when HolisticTraceAnalysis is not installed or the traces hold no GPU
    kernels.
    """
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        log.warning(
            "HolisticTraceAnalysis is not installed: GPU idle time and kernel breakdown are left out of the "
            "doctor's report (%s)",
            pip_install("profile"),
        )
        return None
    try:
        analysis = TraceAnalysis(trace_dir=str(trace_dir))
        temporal = analysis.get_temporal_breakdown(visualize=False)
        by_type, _ = analysis.get_gpu_kernel_breakdown(visualize=False)
    except (AttributeError, IndexError, KeyError, ValueError) as err:  # HTA: no GPU kernels (pandas 3: AttributeError)
        log.warning("HolisticTraceAnalysis could not read GPU kernels from %s (%s): left out", trace_dir, err)
        return None
    row = temporal.sort_values("rank").iloc[0]
    return {
        "ranks": len(temporal),
        "gpu_idle_share": float(row["idle_time_pctg"]) / 100,
        "gpu_compute_share": float(row["compute_time_pctg"]) / 100,
        "gpu_non_compute_share": float(row["non_compute_time_pctg"]) / 100,
        "kernel_time_s": float(row["kernel_time(us)"]) / 1e6,
        "kernel_type_share": {
            str(kind): float(pct) / 100 for kind, pct in zip(by_type["kernel_type"], by_type["percentage"], strict=True)
        },
    }
