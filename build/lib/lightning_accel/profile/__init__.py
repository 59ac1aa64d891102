"""Profile and diagnose: torch.profiler over a window of steps, NVTX ranges, and the bottleneck doctor."""

from lightning_accel.profile.doctor import Finding, diagnose, load_run, report
from lightning_accel.profile.ranges import PhaseRanges
from lightning_accel.profile.torch_profiler import TorchProfiler

__all__ = ["Finding", "PhaseRanges", "TorchProfiler", "diagnose", "load_run", "report"]
