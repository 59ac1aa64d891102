"""What ``tune`` shows and writes: the trial table, ``tune.json``, ``tune.png`` and the tuned recipe YAML."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from lightning_accel.figures import pyplot
from lightning_accel.monitor.summary import wide_console
from lightning_accel.tuning.search import Trial, TuneResult
from lightning_accel.tuning.space import Candidate
from lightning_accel.tuning.trial import OWN_FEATURES

__all__ = [
    "STEP_ARGS",
    "plot",
    "print_report",
    "trial_line",
    "trial_table",
    "tuned_config",
    "write_json",
    "write_tuned_yaml",
]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _world_size(result: TuneResult) -> int:
    return result.baseline.result.world_size if result.baseline.result else 1


def trial_table(result: TuneResult) -> Table:
    title = f"lightning-accel tune: {len(result.trials)} trials in {result.elapsed_s:.0f}s"
    if _world_size(result) > 1:
        title += f" (samples/s and batch per device, {_world_size(result)} devices)"
    caption = (
        "samples/s: the trial's first run; amortized: the mean of all its runs, compile time spread over the "
        "recipe's planned samples (what the choice is made on)"
    )
    table = Table(title=title, caption=caption)
    for column in ("#", "stage", "settings", "samples/s", "amortized", "MFU", "peak MB", "compile s", "verdict"):
        table.add_column(column, overflow="fold")
    for i, t in enumerate(result.trials):
        r = t.result
        table.add_row(
            str(i),
            t.stage,
            t.candidate.label(),
            _fmt(r.samples_per_sec if r else None, ".1f"),
            _fmt(t.amortized_sps, ".1f"),
            _fmt(t.mfu, ".1%"),
            _fmt(r.peak_memory_mb if r else None, ".0f"),
            _fmt(r.compile_s if r and r.compile_s else None, ".1f"),
            t.verdict,
            style="bold green" if t is result.best else None,
        )
    return table


def print_report(result: TuneResult, console: Console | None = None) -> None:
    console = console or wide_console(stderr=True)
    console.print(trial_table(result))
    console.print(
        f"chosen: {result.best.candidate.label()}: {result.speedup:.2f}x the untuned recipe "
        f"({_fmt(result.best.amortized_sps, '.1f')} vs {_fmt(result.baseline.amortized_sps, '.1f')} samples/s)"
    )
    for note in result.notes:
        console.print(f"note: {note}")


def write_json(result: TuneResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.as_dict(), indent=2))
    return path


def plot(result: TuneResult, path: Path) -> Path:
    """Horizontal bars of amortized samples/s per trial: the chosen one green, rejected and failed ones grey."""
    plt = pyplot()

    measured = [t for t in result.trials if t.amortized_sps is not None]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(measured) + 1.5))
    labels = [f"{t.stage}: {t.candidate.label()}" for t in measured]
    colors = [
        "#55A868" if t is result.best else "#999999" if t.verdict.startswith(("rejected", "failed")) else "#4C72B0"
        for t in measured
    ]
    bars = ax.barh(labels, [t.amortized_sps for t in measured], color=colors)
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    if result.baseline.amortized_sps:
        ax.axvline(result.baseline.amortized_sps, color="k", linestyle="--", linewidth=1, label="untuned")
        ax.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("samples/s (compile time amortized over the planned run)")
    ax.set_title(f"tune: chosen {result.speedup:.2f}x the untuned recipe", fontsize=10)
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# Callback arguments counted in optimizer steps: scaled with the batch so they keep meaning the same samples.
STEP_ARGS = ("every_n_steps", "every_n_train_steps", "warmup_steps")


def _compile_callback(candidate: Candidate, block_names: list[str]) -> dict[str, Any]:
    init: dict[str, Any] = {}
    if candidate.compile == "blocks":
        init["modules"] = block_names
    if candidate.compile_mode:
        init["mode"] = candidate.compile_mode
    return {"class_path": "lightning_accel.TorchCompile", "init_args": init}


def tuned_config(
    recipe: dict[str, Any], result: TuneResult, block_names: list[str]
) -> tuple[dict[str, Any], list[str]]:
    """The recipe with the chosen settings applied, and one line per change saying what was measured."""
    config = json.loads(json.dumps(recipe))  # a deep copy of plain YAML data
    best, base = result.best.candidate, result.baseline.candidate
    trainer = config.setdefault("trainer", {})
    data_args = config.setdefault("data", {}).setdefault("init_args", {})
    lines = []
    speed = f"{result.speedup:.2f}x the untuned recipe"
    if best.precision and best.precision != base.precision:
        lines.append(f"trainer.precision: {trainer.get('precision', 'default')} -> {best.precision}")
        trainer["precision"] = best.precision
    callbacks = [c for c in trainer.get("callbacks") or [] if "Compile" not in str(c.get("class_path", ""))]
    if best.compile != "off":
        callbacks.append(_compile_callback(best, block_names))
        lines.append(f"compile: {best.compile}" + (f" ({best.compile_mode})" if best.compile_mode else ""))
    if best.compile != base.compile or best.compile_mode != base.compile_mode:
        trainer["callbacks"] = callbacks
    for kind, knob, arg in OWN_FEATURES:  # in the order a trial adds them: the tuned run is the measured one
        value, name = getattr(best, knob), kind.__name__
        class_path = f"lightning_accel.{name}"
        if value == getattr(base, knob):
            continue
        # the recipe's own one (if any) goes: measured without it, or with another setting, the tuned run was faster
        kept = [c for c in trainer.get("callbacks") or [] if str(c.get("class_path", "")).rsplit(".", 1)[-1] != name]
        if len(kept) < len(trainer.get("callbacks") or []):
            lines.append(f"callback {name}({arg}={getattr(base, knob)!r}) removed: it cost more than it bought")
        if value:
            kept.append({"class_path": class_path, "init_args": {arg: value}})
            lines.append(f"callback {name}({arg}={value!r})")
        trainer["callbacks"] = kept
    for knob in ("num_workers", "pin_memory", "persistent_workers", "batch_size"):
        value = getattr(best, knob)
        if value is not None and value != getattr(base, knob):
            lines.append(f"data.init_args.{knob}: {data_args.get(knob, 'default')} -> {value}")
            data_args[knob] = value
    old_batch = int(result.baseline.result.batch_size or 0) if result.baseline.result else 0
    new_batch = int(result.best.result.batch_size or 0) if result.best.result else 0
    recipe_accumulate = int(trainer.get("accumulate_grad_batches", 1))
    devices = _world_size(result)  # the trials trained on the recipe's devices: the global batch spans them
    old_global = devices * old_batch * (base.accumulate_grad_batches or recipe_accumulate)
    new_global = devices * new_batch * (best.accumulate_grad_batches or recipe_accumulate)
    if best.accumulate_grad_batches is not None and best.accumulate_grad_batches != base.accumulate_grad_batches:
        trainer["accumulate_grad_batches"] = best.accumulate_grad_batches
        lines.append(f"trainer.accumulate_grad_batches -> {best.accumulate_grad_batches} (global batch kept)")
    if old_global and new_global and new_global != old_global:
        # Same number of samples as the untuned run: fewer, larger steps.
        factor = old_global / new_global
        places = [("trainer", trainer, key) for key in ("max_steps", "val_check_interval", "log_every_n_steps")]
        for callback in trainer.get("callbacks") or []:
            args = callback.get("init_args") or {}
            name = str(callback.get("class_path", "")).rsplit(".", 1)[-1]
            places += [(name, args, key) for key in STEP_ARGS if key in args]
        for owner, mapping, key in places:
            value = mapping.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                mapping[key] = max(1, math.ceil(value * factor))
                lines.append(f"{owner}.{key}: {value} -> {mapping[key]} (same samples with the larger batch)")
        lines.append(
            f"the global batch changed {old_global} -> {new_global}: retune the learning rate if the loss "
            "curve matters (tune --keep-global-batch keeps it)"
        )
    lines.insert(
        0,
        f"measured: {speed}, {result.best.amortized_sps or 0:.1f} vs "
        f"{result.baseline.amortized_sps or 0:.1f} samples/s",
    )
    return config, lines


def write_tuned_yaml(recipe_path: Path, result: TuneResult, out: Path, block_names: list[str]) -> Path:
    """``out``: the recipe with the chosen settings and a header of comments saying what was measured."""
    recipe = yaml.safe_load(recipe_path.read_text()) or {}
    config, lines = tuned_config(recipe, result, block_names)
    shown = os.path.relpath(out) if not os.path.relpath(out).startswith("..") else str(out)
    header = [
        f"# Tuned by `lightning-accel tune --config {recipe_path}` ({len(result.trials)} trials, "
        f"{result.elapsed_s:.0f}s of a {result.budget_s:.0f}s budget).",
        *(f"#   {line}" for line in lines),
        f"#   every trial: {out.with_suffix('.json').name} and {out.with_suffix('.png').name} beside this file",
        f"# Run it: lightning-accel fit --config {shown}",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False, default_flow_style=None))
    return out


def trial_line(trial: Trial) -> str:
    """One line for the live progress log."""
    r = trial.result
    speed = f"{r.samples_per_sec:.1f} samples/s" if r and r.samples_per_sec else "-"
    return f"[{trial.stage}] {trial.candidate.label()}: {speed}: {trial.verdict}"
