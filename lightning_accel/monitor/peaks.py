"""Peak FLOP/s per device and dtype, for MFU.

MFU is measured against *dense* peaks (the PaLM convention torchtitan and Composer use too).
Lightning's table (``get_available_flops``) covers most NVIDIA GPUs with dense numbers, but it does
not recognise the name an H200 reports ("NVIDIA H200"), and its H200 and H100 NVL rows are the
with-sparsity datasheet figures, twice the dense ones. Those, and AMD's MI300X/MI250X, come from
the table here first. CPU peaks are estimates (cores x clock x FLOPs per cycle), labelled as such.
"""

from __future__ import annotations

import psutil
import torch
from lightning.fabric.utilities.throughput import get_available_flops

from lightning_accel.host import usable_cores

__all__ = ["cpu_flops_per_cycle", "cpu_peak_flops", "gpu_peak_flops", "peak_flops", "precision_dtype"]

# Dense peaks in FLOP/s from the vendor datasheets (sparsity figures halved), matched in order as
# substrings of the lower-cased device name: "h200 nvl" before "h200".
_GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200), H200 NVL column: BF16/FP16 1,671 and TF32 835
    # TFLOPS with sparsity, FP32 60 TFLOPS.
    ("h200 nvl", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60.0e12}),
    # Same datasheet, H200 SXM column: BF16/FP16 1,979 and TF32 989 TFLOPS with sparsity, FP32 67 TFLOPS.
    ("h200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100), H100 NVL column: BF16/FP16 1,671 and TF32 835
    # TFLOPS with sparsity, FP32 60 TFLOPS.
    ("h100 nvl", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60.0e12}),
    # AMD Instinct MI300X data sheet (amd.com/en/products/accelerators/instinct/mi300/mi300x.html): dense
    # FP16/BF16 1,307.4, TF32 653.7, FP32 163.4 TFLOPS.
    ("mi300x", {"bf16": 1307.4e12, "fp16": 1307.4e12, "tf32": 653.7e12, "fp32": 163.4e12}),
    # AMD Instinct MI250X data sheet (amd.com/en/products/accelerators/instinct/mi200/mi250x.html): FP16/BF16
    # 383, FP32 matrix 95.7 (used for "tf32": CDNA2 has no TF32), FP32 vector 47.9 TFLOPS.
    ("mi250x", {"bf16": 383.0e12, "fp16": 383.0e12, "tf32": 95.7e12, "fp32": 47.9e12}),
)


def gpu_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Dense peak of a GPU by the name torch reports, from the table above (``None``: not in it).

    ``tf32`` picks the TF32 tensor-core peak for fp32 matmuls (``torch.set_float32_matmul_precision``
    "high" or "medium").
    """
    name = device_name.lower()
    for key, table in _GPU_PEAKS:
        if key in name:
            if dtype == torch.float32:
                return table["tf32" if tf32 else "fp32"]
            return table.get({torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, ""))
    return None


def cpu_flops_per_cycle() -> float:
    """fp32 FLOPs per cycle per core: 2 FMA units x lanes x 2 (multiply + add)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    if " avx512f" in flags:
        return 64.0  # 16 fp32 lanes
    if " fma" in flags:
        return 32.0  # AVX2: 8 lanes
    return 8.0  # SSE, or not x86 / unknown: a conservative guess


def precision_dtype(precision: str) -> torch.dtype:
    """Compute dtype of matmuls under a Lightning precision string."""
    if precision.startswith("16") or precision == "transformer-engine-float16":
        return torch.float16
    if precision.startswith("bf16") or precision == "transformer-engine":
        return torch.bfloat16  # fp8 MFU is reported against the bf16 peak, the common convention
    if precision.startswith("64"):
        return torch.float64
    return torch.float32


def cpu_peak_flops(num_cores: int | None = None, freq_mhz: float | None = None) -> float:
    """Estimated fp32 peak of this process's usable cores (an estimate: no datasheet for a CPU)."""
    if num_cores is None:
        num_cores = usable_cores()
    if freq_mhz is None:
        freq = psutil.cpu_freq()
        freq_mhz = (freq.max or freq.current) if freq else 0.0
        freq_mhz = freq_mhz or 2500.0  # VMs often hide the clock; assume a typical server core
    return num_cores * freq_mhz * 1e6 * cpu_flops_per_cycle()


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """Peak FLOP/s of ``device`` for ``dtype`` and where the number comes from (``None`` if unknown)."""
    if device.type == "cpu":
        return cpu_peak_flops(), "cpu-estimate"
    if device.type == "cuda":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        ours = gpu_peak_flops(torch.cuda.get_device_name(device), dtype, tf32)
        if ours is not None:
            return ours, "datasheet"
        flops = get_available_flops(device, dtype)  # Lightning's table; it applies TF32 the same way
        return (float(flops), "datasheet") if flops else (None, "unknown device")
    return None, "unknown device"
