"""The doctor's rules: one small function per finding, listed in :data:`RULES`.

Each rule reads a :class:`RunFacts` (what the goodput ledger and the profiler recorded) and returns a
:class:`Finding` or ``None``. A new finding is one function here and one row in the table; ``compute`` is not a
row: it is the verdict when no rule found a cost above :data:`INPUT_SHARE`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from lightning_accel.monitor.accounting import INPUT_BOUND_SHARE, STRAGGLER_RATIO

__all__ = [
    "CHECKPOINT_SHARE",
    "COST_SHARE",
    "DISPATCH_S",
    "GPU_BUSY",
    "HOST_SHARE",
    "INPUT_SHARE",
    "MEMORY_HEADROOM",
    "MODEL_PHASES",
    "OTHER_SHARE",
    "RULES",
    "STEP_PHASES",
    "VALIDATION_SHARE",
    "Finding",
    "RunFacts",
    "checkpoint_rule",
    "compute_verdict",
    "cost_rule",
    "host_overhead_rule",
    "input_rule",
    "low_utilization_rule",
    "memory_headroom_rule",
    "pageable_copy_rule",
    "precision_rule",
    "straggler_rule",
    "sync_rule",
    "validation_rule",
]

# Thresholds: a finding is raised above these (shares of wall time unless said otherwise).
INPUT_SHARE = INPUT_BOUND_SHARE  # GoodputMonitor's input-bound warning uses the same share and threshold
CHECKPOINT_SHARE = 0.05
VALIDATION_SHARE = 0.15
OTHER_SHARE = 0.20
DISPATCH_S = 5e-6  # host time PyTorch eager spends per op before any compute (dispatch, autograd bookkeeping)
HOST_SHARE = 0.10  # estimated dispatch share of the step above which compile / larger batches pay
GPU_BUSY = 0.90
MEMORY_HEADROOM = 0.5  # peak under half the device's memory
COST_SHARE = 0.10  # checkpoints plus work redone after restarts, as a share of the run's cost
STEP_PHASES = ("forward", "backward", "optimizer")
MODEL_PHASES = ("forward", "backward")  # host reads here are the model's (an optimizer's are its own business)


@dataclass(frozen=True)
class Finding:
    """One bottleneck: what it is, how much of the step it costs, the numbers behind it, and the change to make."""

    kind: str
    share: float
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""


@dataclass
class RunFacts:
    """A run's recorded results (``goodput.json``) and profile summary (``profile_summary.json``, or empty)."""

    goodput: dict[str, Any]
    profile: dict[str, Any]

    def share(self, bucket: str) -> float:
        return float(self.goodput.get(f"goodput/{bucket}_share", 0.0))

    @cached_property
    def on_gpu(self) -> bool:
        return str(self.goodput.get("device", self.profile.get("device", "cpu"))).startswith("cuda")

    @property
    def step_s(self) -> float:
        return self.profile.get("step_s") or 0.0

    @cached_property
    def step_ops(self) -> float | None:
        """The step's own ops per step (a dataset's indexing runs in the loader: the input rule's business)."""
        by_phase = self.profile.get("aten_ops_per_step_by_phase")
        return sum(by_phase.get(p, 0.0) for p in STEP_PHASES) if by_phase else self.profile.get("aten_ops_per_step")

    @property
    def dispatch_share(self) -> float:
        """Estimated share of the step the host spends dispatching ops."""
        return (self.step_ops or 0) * DISPATCH_S / self.step_s if self.step_s else 0.0


def _share_finding(
    run: RunFacts, kind: str, bucket: str, threshold: float, fix: str, **evidence: Any
) -> Finding | None:
    """A finding when ``bucket``'s share of the run passes ``threshold``: the rules that are one share."""
    share = run.share(bucket)
    if share <= threshold:
        return None
    return Finding(kind, share, {f"{bucket}_share": share, **evidence}, fix)


def input_rule(run: RunFacts) -> Finding | None:
    remote = run.goodput.get("data_source")  # an object-store URL the data is read from, as GoodputMonitor saw it
    fix = (
        f"The step waits for reads from {remote}: read further ahead (DALI's prefetch_queue_depth, or the "
        "DataLoader's prefetch_factor), more reader threads (DALIImageDataModule(num_threads=...), num_workers), or "
        "copy the data set to a local cache (NVMe) once per node and read it from there."
        if remote
        else "The step waits for the train loader: DataLoader(num_workers=<cores per GPU>, pin_memory=True, "
        "persistent_workers=True), or decode and augment with lightning_accel.data.DALIImageDataModule."
    )
    return _share_finding(
        run, "input", "data", INPUT_SHARE, fix, data_wait_share=run.goodput.get("throughput/data_wait_share")
    )


def checkpoint_rule(run: RunFacts) -> Finding | None:
    return _share_finding(
        run,
        "checkpoint",
        "checkpoint",
        CHECKPOINT_SHARE,
        "Saves stall training: PreemptionCheckpoint(async_save=True), save less often (a larger "
        "every_n_steps / every_n_seconds), or a faster disk for dirpath.",
        checkpoint_s=run.goodput.get("goodput/checkpoint_s"),
    )


def validation_rule(run: RunFacts) -> Finding | None:
    return _share_finding(
        run,
        "validation",
        "validation",
        VALIDATION_SHARE,
        "Validation takes a large part of the run: a larger Trainer(val_check_interval=...) or "
        "check_val_every_n_epoch, or limit_val_batches.",
    )


def host_overhead_rule(run: RunFacts) -> Finding | None:
    other, dispatch = run.share("other"), run.dispatch_share
    many_ops = dispatch > HOST_SHARE
    if other <= OTHER_SHARE and not many_ops:
        return None
    evidence: dict[str, Any] = {"other_share": other}
    if run.step_ops is not None:
        evidence.update(
            {"step_ops_per_step": run.step_ops, "step_ms": 1000 * run.step_s, "est_dispatch_share": dispatch}
        )
    fix = "The host is the bottleneck: "
    if many_ops and run.on_gpu:
        fix += (
            "fuse the many small ops with lightning_accel.TorchCompile(mode='reduce-overhead') (CUDA graphs "
            "replay the step with one launch) or train on larger batches; "
        )
    elif many_ops:  # on a CPU compile gains little (benchmarks/precision_compile.py): the batch is the lever
        fix += (
            "train on larger batches (each op's host cost is paid once per batch, whatever its size), or "
            "fuse ops with lightning_accel.TorchCompile() and measure it; "
        )
    fix += "log less often (Trainer(log_every_n_steps=...)) and drop or slim per-batch callbacks."
    return Finding("host_overhead", max(other, min(dispatch, 1.0)), evidence, fix)


def sync_rule(run: RunFacts) -> Finding | None:
    syncs = run.profile.get("sync_calls_per_step") or {}
    reads = {p: n for p, n in (run.profile.get("host_reads_per_step") or {}).items() if p in MODEL_PHASES}
    if not reads and not (run.on_gpu and sum(syncs.values()) >= 1):
        return None
    hta = run.profile.get("hta") or {}
    busy, step = run.profile.get("device_busy_s_per_step"), run.profile.get("step_s")
    idle = hta.get("gpu_idle_share", 1.0 - busy / step if busy is not None and step else 0.0)
    evidence: dict[str, Any] = {"host_reads_per_step": reads, "sync_calls_per_step": syncs or None}
    if not run.on_gpu:
        evidence["measured"] = "count only: on a CPU a read is no stall, on a GPU each one is a full sync"
    what = (
        f"training_step reads {sum(reads.values()):g} tensor(s) back to the host per step: "
        if reads
        else f"The host waits for the device {sum(syncs.values()):g} time(s) per step: "
    )
    return Finding(
        "sync",
        idle if run.on_gpu else 0.0,  # each sync drains the GPU's queue: the device idles until the host queues
        evidence,
        what + "remove .item() / .cpu() / float(tensor) / print(tensor) from the step, log tensors (self.log "
        "accepts them) and reduce on the host only every log_every_n_steps.",
    )


def pageable_copy_rule(run: RunFacts) -> Finding | None:
    pageable = run.profile.get("pageable_copies_per_step", 0.0)
    if not pageable:
        return None
    copy_s = run.profile.get("pageable_copy_s_per_step", 0.0)
    return Finding(
        "pageable_copy",
        copy_s / run.step_s if run.step_s else 0.0,
        {"pageable_copies_per_step": pageable, "copy_ms_per_step": 1000 * copy_s},
        "Host-to-device copies from pageable memory cannot overlap compute: DataLoader(pin_memory=True) "
        "(DALIImageDataModule outputs on the GPU already).",
    )


def low_utilization_rule(run: RunFacts) -> Finding | None:
    busy = run.profile.get("device_busy_s_per_step")
    hta = run.profile.get("hta") or {}
    if not run.on_gpu or not (hta or (busy is not None and run.step_s)):
        return None
    # HolisticTraceAnalysis measures idle gaps between kernels; without it, kernel time over step time
    utilization = 1.0 - hta["gpu_idle_share"] if hta else busy / run.step_s
    if utilization >= GPU_BUSY:
        return None
    return Finding(
        "low_utilization",
        1.0 - utilization,
        {
            "gpu_busy_share": utilization,
            "step_ms": 1000 * run.step_s if run.step_s else None,
            "kernel_type_share": hta.get("kernel_type_share"),
        },
        "The GPU idles for part of every step: fix the findings above (input, host overhead, syncs) "
        "first; then a larger batch per GPU.",
    )


def precision_rule(run: RunFacts) -> Finding | None:
    precision = str(run.goodput.get("precision", ""))
    if not (run.on_gpu and precision.startswith("32")):
        return None
    compute = run.share("compute")
    return Finding(
        "precision",
        compute / 2,  # bf16 tensor cores: at least twice the fp32 matmul rate
        {"precision": precision, "compute_share": compute},
        "fp32 matmuls on a GPU with bf16: Trainer(precision='bf16-mixed') (or 'auto-mixed'); "
        "or torch.set_float32_matmul_precision('high') for TF32.",
    )


def memory_headroom_rule(run: RunFacts) -> Finding | None:
    peak, total = run.profile.get("memory_peak_gib"), run.profile.get("memory_total_gib")
    if peak is None or not total or peak / total >= MEMORY_HEADROOM:
        return None
    return Finding(
        "memory_headroom",
        0.0,
        {"memory_peak_gib": peak, "memory_total_gib": total},
        f"Only {peak / total:.0%} of GPU memory is used: a batch up to {total / peak * 0.8:.1f}x larger "
        "fits (keep the global batch with accumulate_grad_batches, or scale the learning rate).",
    )


def straggler_rule(run: RunFacts) -> Finding | None:
    ratio, rank = run.goodput.get("goodput/straggler_ratio"), run.goodput.get("goodput/slowest_rank")
    named = run.goodput.get("goodput/straggler_rank")  # the monitor's decision (ratio and MADs); older runs lack it
    if ratio is None or rank is None or (named is not None and named < 0) or ratio < STRAGGLER_RATIO:
        return None
    host = run.goodput.get("straggler_host")
    where = f"Rank {int(rank)}" + (f" (host {host})" if host else "")
    evidence = {"slowest_rank": int(rank), "straggler_ratio": ratio, **({"host": host} if host else {})}
    return Finding(
        "straggler",
        1.0 - 1.0 / ratio,  # of the slowest rank's pre-sync time, what the others spend waiting for it
        evidence,
        f"{where} spends {ratio:.2f}x the other ranks' median time per step before the gradient sync (its data, "
        "transfer and forward), and every other rank waits for it: check that host's load (another job, thermal "
        "throttling, a slower device), its data path (local disk or network, loader workers) and the size of its "
        "input shard.",
    )


def cost_rule(run: RunFacts) -> Finding | None:
    total = run.goodput.get("cost/total_usd")
    if not total:
        return None  # no price given
    saving, lost = run.goodput.get("cost/checkpoint_usd", 0.0), run.goodput.get("cost/lost_usd", 0.0)
    share = (saving + lost) / total
    if share < COST_SHARE:
        return None
    return Finding(
        "cost",
        share,
        {"checkpoint_usd": saving, "lost_usd": lost, "total_usd": total},
        f"Checkpoint saves cost ${saving:.2f} and work redone after restarts ${lost:.2f}: {share:.0%} of the "
        f"run's ${total:.2f}. Save asynchronously (PreemptionCheckpoint(async_save=True)); balance the save "
        "interval against how often the run is preempted (a save every N steps loses N/2 steps per preemption "
        "on average, and costs one save per N steps); keep the state smaller (a sharded strategy saves shards).",
    )


def compute_verdict(run: RunFacts) -> Finding:
    """Where a run should be: the verdict when no rule found a larger cost."""
    compute = run.share("compute")
    return Finding(
        "compute",
        compute,
        {"compute_share": compute, "mfu": run.goodput.get("throughput/mfu")},
        "Compute-bound, which is where a run should be: from here, TorchCompile(), bf16 on GPUs, a fused "
        "optimizer (torch.optim.AdamW(fused=True)), or a larger model per GPU for better MFU.",
    )


# Every rule, by the kind of finding it raises.
RULES: dict[str, Callable[[RunFacts], Finding | None]] = {
    "input": input_rule,
    "checkpoint": checkpoint_rule,
    "validation": validation_rule,
    "host_overhead": host_overhead_rule,
    "sync": sync_rule,
    "pageable_copy": pageable_copy_rule,
    "low_utilization": low_utilization_rule,
    "precision": precision_rule,
    "memory_headroom": memory_headroom_rule,
    "straggler": straggler_rule,
    "cost": cost_rule,
}
