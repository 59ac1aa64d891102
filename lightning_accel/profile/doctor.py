"""The bottleneck doctor: ranked findings, each with the share of time it costs, the numbers, and the fix.

Reads what a run left in its folder: ``goodput.json`` (``GoodputMonitor``: the ledger, throughput, MFU) and
``profile/profile_summary.json`` (``TorchProfiler``: ops per step, sync points, copies, device busy time,
memory). Pure: :func:`diagnose` runs every rule of ``rules.py`` on those dicts and returns the findings;
:func:`report` prints and writes them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lightning_accel.checkpoint.destination import is_run_file
from lightning_accel.figures import pyplot
from lightning_accel.monitor.goodput import RESULTS_FILE
from lightning_accel.monitor.ledger import BUCKETS
from lightning_accel.monitor.plot import COLORS
from lightning_accel.monitor.summary import format_value
from lightning_accel.profile.gpu_trace import hta_breakdown
from lightning_accel.profile.rules import INPUT_SHARE, RULES, Finding, RunFacts, compute_verdict
from lightning_accel.profile.torch_profiler import SUMMARY_FILE
from lightning_accel.storage import download_dir, download_tree, filesystem, is_remote, parse_json_object, redact

__all__ = ["diagnose", "load_run", "report"]

log = logging.getLogger(__name__)


def diagnose(goodput: dict[str, Any] | str | Path, profile: dict[str, Any] | None = None) -> list[Finding]:
    """Findings from a run folder, or from its goodput results and (optionally) profile summary; largest first."""
    if isinstance(goodput, (str, Path)):
        goodput, profile = load_run(goodput)
    run = RunFacts(goodput, profile or {})
    findings = [f for rule in RULES.values() if (f := rule(run)) is not None]
    if not any(f.share > INPUT_SHARE for f in findings):
        findings.append(compute_verdict(run))
    return sorted(findings, key=lambda f: -f.share)


def load_run(run_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(goodput results, profile summary or None)`` from a run folder (the summary may sit in ``profile/``); a bucket
    URL (a ``PreemptionCheckpoint`` dirpath in object storage) is read through a local copy of its run files."""
    if is_remote(str(run_dir)):
        fs, root = filesystem(str(run_dir))
        local = download_dir(str(run_dir)) / "run"
        if not download_tree(fs, root, local, is_run_file):
            raise FileNotFoundError(f"No run files under {redact(str(run_dir))} (expected {RESULTS_FILE})")
        run_dir = local
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"Run folder {run_dir} does not exist")
    results = next((p for p in (run_dir / RESULTS_FILE, *run_dir.rglob(RESULTS_FILE)) if p.is_file()), None)
    if results is None:
        raise FileNotFoundError(
            f"No {RESULTS_FILE} under {run_dir}: train with lightning_accel.GoodputMonitor(run_dir={str(run_dir)!r}) "
            "(or `lightning-accel profile --config ...`), then run the doctor on that folder"
        )
    summary_path = next((p for p in (run_dir / SUMMARY_FILE, *run_dir.rglob(SUMMARY_FILE)) if p.is_file()), None)
    summary = _read_run_file(summary_path) if summary_path else None
    if summary is not None and summary.get("device") == "cuda" and "hta" not in summary:
        summary["hta"] = hta_breakdown(summary_path.parent)  # type: ignore[union-attr]
    return _read_run_file(results), summary


def _read_run_file(path: Path) -> dict[str, Any]:
    value = parse_json_object(path.read_bytes())
    if value is None:  # torn or edited: one clear line, not a parser's traceback
        raise ValueError(f"{path} is not a JSON object (a torn write, or edited): train again to write a new one")
    return value


def report(findings: list[Finding], goodput: dict[str, Any], profile: dict[str, Any] | None, run_dir: Path) -> Path:
    """Print the findings as a table and write ``doctor.md`` with ``doctor.png`` into ``run_dir``."""
    table = Table(title="lightning-accel doctor", show_lines=True)
    for column in ("#", "kind", "share", "evidence", "fix"):
        table.add_column(column, overflow="fold")
    for i, f in enumerate(findings, 1):
        evidence = ", ".join(f"{k}={format_value(v)}" for k, v in f.evidence.items() if v is not None)
        table.add_row(str(i), f.kind, f"{f.share:.0%}", evidence, f.fix)
    Console().print(table)
    run_dir.mkdir(parents=True, exist_ok=True)
    png = _plot(goodput, profile, run_dir / "doctor.png")
    lines = ["# lightning-accel doctor", "", "| # | kind | share | evidence | fix |", "|---|---|---|---|---|"]
    for i, f in enumerate(findings, 1):
        evidence = "; ".join(f"{k}={format_value(v)}" for k, v in f.evidence.items() if v is not None)
        lines.append(f"| {i} | `{f.kind}` | {f.share:.0%} | {evidence} | {f.fix} |")
    lines += ["", f"![time breakdown and top ops]({png.name})", ""]
    (run_dir / "doctor.md").write_text("\n".join(lines))
    (run_dir / "doctor.json").write_text(json.dumps([asdict(f) for f in findings], indent=1, default=str))
    return run_dir / "doctor.md"


def _plot(goodput: dict[str, Any], profile: dict[str, Any] | None, path: Path) -> Path:
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    shares = [RunFacts(goodput, profile or {}).share(b) for b in BUCKETS]
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
