"""The bottleneck doctor: ranked findings, each with the share of time it costs, the numbers, and the fix.

Reads what a run left in its folder: ``goodput.json`` (``GoodputMonitor``: the ledger, throughput, MFU) and
``profile/profile_summary.json`` (``TorchProfiler``: ops per step, sync points, copies, device busy time,
memory). Pure: :func:`diagnose` takes those dicts and returns findings; :func:`report` prints and writes them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_accel.monitor.goodput import RESULTS_FILE
from lightning_accel.monitor.ledger import BUCKETS
from lightning_accel.monitor.plot import COLORS
from lightning_accel.monitor.summary import format_value
from lightning_accel.profile.gpu_trace import hta_breakdown
from lightning_accel.profile.torch_profiler import SUMMARY_FILE

log = logging.getLogger(__name__)

# Thresholds: a finding is raised above these (shares of wall time unless said otherwise).
INPUT_SHARE = 0.10
CHECKPOINT_SHARE = 0.05
VALIDATION_SHARE = 0.15
OTHER_SHARE = 0.20
DISPATCH_S = 5e-6  # host time PyTorch eager spends per op before any compute (dispatch, autograd bookkeeping)
HOST_SHARE = 0.10  # estimated dispatch share of the step above which compile / larger batches pay
GPU_BUSY = 0.90
MEMORY_HEADROOM = 0.5  # peak under half the device's memory
STEP_PHASES = ("forward", "backward", "optimizer")
MODEL_PHASES = ("forward", "backward")  # host reads here are the model's (an optimizer's are its own business)


@dataclass(frozen=True)
class Finding:
    """One bottleneck: what it is, how much of the step it costs, the numbers behind it, and the change to make."""

    kind: str
    share: float
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""


def _share(goodput: dict[str, Any], bucket: str) -> float:
    return float(goodput.get(f"goodput/{bucket}_share", 0.0))


def diagnose(goodput: dict[str, Any] | str | Path, profile: dict[str, Any] | None = None) -> list[Finding]:
    """Findings from a run folder, or from its goodput results and (optionally) profile summary; largest first."""
    if isinstance(goodput, (str, Path)):
        goodput, profile = load_run(goodput)
    profile = profile or {}
    findings: list[Finding] = []
    on_gpu = str(goodput.get("device", profile.get("device", "cpu"))).startswith("cuda")
    data = _share(goodput, "data")
    if data > INPUT_SHARE:
        findings.append(
            Finding(
                "input",
                data,
                {"data_share": data, "data_wait_share": goodput.get("throughput/data_wait_share")},
                "The step waits for the train loader: DataLoader(num_workers=<cores per GPU>, pin_memory=True, "
                "persistent_workers=True), or decode and augment with lightning_accel.data.DALIImageDataModule.",
            )
        )
    checkpoint = _share(goodput, "checkpoint")
    if checkpoint > CHECKPOINT_SHARE:
        findings.append(
            Finding(
                "checkpoint",
                checkpoint,
                {"checkpoint_share": checkpoint, "checkpoint_s": goodput.get("goodput/checkpoint_s")},
                "Saves stall training: PreemptionCheckpoint(async_save=True), save less often (a larger "
                "every_n_steps / every_n_seconds), or a faster disk for dirpath.",
            )
        )
    validation = _share(goodput, "validation")
    if validation > VALIDATION_SHARE:
        findings.append(
            Finding(
                "validation",
                validation,
                {"validation_share": validation},
                "Validation takes a large part of the run: a larger Trainer(val_check_interval=...) or "
                "check_val_every_n_epoch, or limit_val_batches.",
            )
        )
    other = _share(goodput, "other")
    by_phase = profile.get("aten_ops_per_step_by_phase")
    # the step's own ops (a dataset's indexing runs in the loader, and is the input finding's business)
    ops = sum(by_phase.get(p, 0.0) for p in STEP_PHASES) if by_phase else profile.get("aten_ops_per_step")
    step_s = profile.get("step_s") or 0.0
    dispatch = (ops or 0) * DISPATCH_S / step_s if step_s else 0.0
    many_ops = dispatch > HOST_SHARE
    if other > OTHER_SHARE or many_ops:
        evidence: dict[str, Any] = {"other_share": other}
        if ops is not None:
            evidence.update({"step_ops_per_step": ops, "step_ms": 1000 * step_s, "est_dispatch_share": dispatch})
        fix = "The host is the bottleneck: "
        if many_ops and on_gpu:
            fix += (
                "fuse the many small ops with lightning_accel.TorchCompile(mode='reduce-overhead') (CUDA graphs "
                "replay the step with one launch) or train on larger batches; "
            )
        elif many_ops:  # on a CPU compile's gain is small (0.93-1.00x on our tiny GPT): the batch is the lever
            fix += (
                "train on larger batches (each op's host cost is paid once per batch, whatever its size), or "
                "fuse ops with lightning_accel.TorchCompile() and measure it; "
            )
        fix += "log less often (Trainer(log_every_n_steps=...)) and drop or slim per-batch callbacks."
        findings.append(Finding("host_overhead", max(other, min(dispatch, 1.0)), evidence, fix))
    syncs = profile.get("sync_calls_per_step") or {}
    reads = {p: n for p, n in (profile.get("host_reads_per_step") or {}).items() if p in MODEL_PHASES}
    if reads or (on_gpu and sum(syncs.values()) >= 1):
        hta = profile.get("hta") or {}
        busy, step = profile.get("device_busy_s_per_step"), profile.get("step_s")
        idle = hta.get("gpu_idle_share", 1.0 - busy / step if busy is not None and step else 0.0)
        evidence = {"host_reads_per_step": reads, "sync_calls_per_step": syncs or None}
        if not on_gpu:
            evidence["measured"] = "count only: on a CPU a read is no stall, on a GPU each one is a full sync"
        findings.append(
            Finding(
                "sync",
                idle if on_gpu else 0.0,  # each sync drains the GPU's queue: the device idles until the host queues
                evidence,
                (
                    f"training_step reads {sum(reads.values()):g} tensor(s) back to the host per step: "
                    if reads
                    else f"The host waits for the device {sum(syncs.values()):g} time(s) per step: "
                )
                + "remove .item() / .cpu() / float(tensor) / print(tensor) from the step, log tensors (self.log "
                "accepts them) and reduce on the host only every log_every_n_steps.",
            )
        )
    pageable = profile.get("pageable_copies_per_step", 0.0)
    if pageable:
        copy_s = profile.get("pageable_copy_s_per_step", 0.0)
        findings.append(
            Finding(
                "pageable_copy",
                copy_s / step_s if step_s else 0.0,
                {"pageable_copies_per_step": pageable, "copy_ms_per_step": 1000 * copy_s},
                "Host-to-device copies from pageable memory cannot overlap compute: DataLoader(pin_memory=True) "
                "(DALIImageDataModule outputs on the GPU already).",
            )
        )
    busy = profile.get("device_busy_s_per_step")
    hta = profile.get("hta") or {}
    if on_gpu and (hta or (busy is not None and step_s)):
        # HolisticTraceAnalysis measures idle gaps between kernels; without it, kernel time over step time
        utilization = 1.0 - hta["gpu_idle_share"] if hta else busy / step_s
        if utilization < GPU_BUSY:
            findings.append(
                Finding(
                    "low_utilization",
                    1.0 - utilization,
                    {
                        "gpu_busy_share": utilization,
                        "step_ms": 1000 * step_s if step_s else None,
                        "kernel_type_share": hta.get("kernel_type_share"),
                    },
                    "The GPU idles for part of every step: fix the findings above (input, host overhead, syncs) "
                    "first; then a larger batch per GPU.",
                )
            )
    precision = str(goodput.get("precision", ""))
    compute = _share(goodput, "compute")
    if on_gpu and precision.startswith("32"):
        findings.append(
            Finding(
                "precision",
                compute / 2,  # bf16 tensor cores: at least twice the fp32 matmul rate
                {"precision": precision, "compute_share": compute},
                "fp32 matmuls on a GPU with bf16: Trainer(precision='bf16-mixed') (or 'auto-mixed'); "
                "or torch.set_float32_matmul_precision('high') for TF32.",
            )
        )
    peak, total = profile.get("memory_peak_gib"), profile.get("memory_total_gib")
    if peak is not None and total and peak / total < MEMORY_HEADROOM:
        findings.append(
            Finding(
                "memory_headroom",
                0.0,
                {"memory_peak_gib": peak, "memory_total_gib": total},
                f"Only {peak / total:.0%} of GPU memory is used: a batch up to {total / peak * 0.8:.1f}x larger "
                "fits (keep the global batch with accumulate_grad_batches, or scale the learning rate).",
            )
        )
    if not any(f.share > INPUT_SHARE for f in findings):
        findings.append(
            Finding(
                "compute",
                compute,
                {"compute_share": compute, "mfu": goodput.get("throughput/mfu")},
                "Compute-bound, which is where a run should be: from here, TorchCompile(), bf16 on GPUs, a fused "
                "optimizer (torch.optim.AdamW(fused=True)), or a larger model per GPU for better MFU.",
            )
        )
    return sorted(findings, key=lambda f: -f.share)


def load_run(run_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(goodput results, profile summary or None)`` from a run folder (the summary may sit in ``profile/``)."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"Run folder {folder} does not exist")
    results = next((p for p in (folder / RESULTS_FILE, *folder.rglob(RESULTS_FILE)) if p.is_file()), None)
    if results is None:
        raise FileNotFoundError(
            f"No {RESULTS_FILE} under {folder}: train with lightning_accel.GoodputMonitor(run_dir={str(folder)!r}) "
            "(or `lightning-accel profile --config ...`), then run the doctor on that folder"
        )
    summary_path = next((p for p in (folder / SUMMARY_FILE, *folder.rglob(SUMMARY_FILE)) if p.is_file()), None)
    summary = json.loads(summary_path.read_text()) if summary_path else None
    if summary is not None and summary.get("device") == "cuda" and "hta" not in summary:
        summary["hta"] = hta_breakdown(summary_path.parent)  # type: ignore[union-attr]
    return json.loads(results.read_text()), summary


def report(findings: list[Finding], goodput: dict[str, Any], profile: dict[str, Any] | None, out: Path) -> Path:
    """Print the findings as a table and write ``doctor.md`` with ``doctor.png`` into ``out``."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lightning-accel doctor", show_lines=True)
    for column in ("#", "kind", "share", "evidence", "fix"):
        table.add_column(column, overflow="fold")
    for i, f in enumerate(findings, 1):
        evidence = ", ".join(f"{k}={format_value(v)}" for k, v in f.evidence.items() if v is not None)
        table.add_row(str(i), f.kind, f"{f.share:.0%}", evidence, f.fix)
    Console().print(table)
    out.mkdir(parents=True, exist_ok=True)
    png = _plot(goodput, profile, out / "doctor.png")
    lines = ["# lightning-accel doctor", "", "| # | kind | share | evidence | fix |", "|---|---|---|---|---|"]
    for i, f in enumerate(findings, 1):
        evidence = "; ".join(f"{k}={format_value(v)}" for k, v in f.evidence.items() if v is not None)
        lines.append(f"| {i} | `{f.kind}` | {f.share:.0%} | {evidence} | {f.fix} |")
    lines += ["", f"![time breakdown and top ops]({png.name})", ""]
    (out / "doctor.md").write_text("\n".join(lines))
    (out / "doctor.json").write_text(json.dumps([asdict(f) for f in findings], indent=1, default=str))
    return out / "doctor.md"


def _plot(goodput: dict[str, Any], profile: dict[str, Any] | None, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    shares = [_share(goodput, b) for b in BUCKETS]
    left.barh(list(BUCKETS), shares, color=[COLORS[b] for b in BUCKETS])
    left.invert_yaxis()
    left.set_xlabel("share of wall time")
    left.set_title("where the time went (goodput ledger)")
    ops = (profile or {}).get("top_ops", [])[:10]
    if ops:
        key = "self_device_s" if any(op["self_device_s"] for op in ops) else "self_cpu_s"
        steps = max((profile or {}).get("steps", 1), 1)
        right.barh([op["name"][:40] for op in ops], [1000 * op[key] / steps for op in ops], color="#4C72B0")
        right.invert_yaxis()
        right.set_xlabel(f"ms per step ({'device' if key == 'self_device_s' else 'CPU'} self time)")
        right.set_title("top ops (torch.profiler)")
        right.tick_params(axis="y", labelsize=7)
    else:
        right.text(0.5, 0.5, "no profile: add lightning_accel.TorchProfiler()", ha="center", va="center")
        right.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
