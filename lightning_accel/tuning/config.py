"""TuneConfig: every knob of a tune search, one docstring under each field; the CLI's options are made from it.

``lightning-accel tune --config RECIPE --budget 5m --max-batch 256`` and ``lightning_accel.tune(recipe, budget="5m",
max_batch=256)`` fill the same dataclass, so a new knob is one field here (and its docstring is its ``--help``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_accel.tuning.trial import TrialSettings

__all__ = ["TuneConfig", "add_cli_options", "config_from_cli", "field_docs", "parse_budget"]


@dataclass
class TuneConfig:
    """How a tune search runs (the recipe or objects it tunes are given beside it)."""

    budget: str | float = "5m"
    """Wall-clock limit for the whole search: seconds, or e.g. 90s, 5m, 1h. No trial starts that the remaining
    budget cannot finish, and a running one is stopped at the limit."""
    out: Path | None = None
    """The tuned recipe to write (default for a recipe: runs/tune/<recipe>/tuned.yaml); tuned.json (every trial) and
    tuned.png go beside it. Tuning objects, only its folder is used, if given."""
    keep_global_batch: bool = False
    """Try larger batches with fewer accumulations, keeping batch_size x accumulate_grad_batches."""
    max_batch: int | None = None
    """Largest batch size to try (default 16x the recipe's)."""
    loss_tolerance: float = 0.05
    """Largest relative drift of the mean loss over the first batches from the fp32 eager reference's before a
    precision or compile candidate is rejected."""
    min_gain: float = 0.02
    """Smallest speedup (a share) that changes a setting."""
    settings: TrialSettings = field(default_factory=TrialSettings)
    """How long each trial trains (warm-up batches, measured seconds)."""

    def __post_init__(self) -> None:
        parse_budget(self.budget)  # a clear error now, not after the first trial
        if self.out is not None:
            self.out = Path(self.out)
        for name in ("loss_tolerance", "min_gain"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 or None, got {self.max_batch}")

    @property
    def budget_s(self) -> float:
        return parse_budget(self.budget)

    @classmethod
    def from_options(cls, **options: Any) -> TuneConfig:
        """A config from keyword arguments named as its fields; an unknown name is an error naming the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"tune() got unknown option(s) {unknown}; TuneConfig has {sorted(known)}")
        return cls(**options)


def parse_budget(budget: str | float | int) -> float:
    """Seconds from ``300``, ``"300"``, ``"90s"``, ``"5m"``, ``"1h"``, ``"1m30s"``."""
    if isinstance(budget, (int, float)):
        seconds = float(budget)
    else:
        text = budget.strip().lower()
        parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", text)
        if not text or parts is None:
            raise ValueError(f"budget {budget!r} is not a duration: use seconds (300) or e.g. '90s', '5m', '1h'")
        h, m, s = (float(p) if p else 0.0 for p in parts.groups())
        seconds = 3600 * h + 60 * m + s
    if seconds <= 0:
        raise ValueError(f"budget must be positive, got {budget!r}")
    return seconds


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source (one line, white space folded)."""
    body = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(str(after.value.value).split())  # type: ignore[union-attr]
    return docs


# CLI option -> (dataclass, field): TuneConfig's own, and the trial length from TrialSettings.
_CLI_FIELDS = (
    (TuneConfig, "budget"),
    (TuneConfig, "out"),
    (TuneConfig, "keep_global_batch"),
    (TuneConfig, "max_batch"),
    (TuneConfig, "loss_tolerance"),
    (TuneConfig, "min_gain"),
    (TrialSettings, "warmup"),
    (TrialSettings, "measure_s"),
)
_TYPES = {"int | None": int, "int": int, "float": float, "Path | None": Path, "str | float": str}


def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """``--budget``, ``--max-batch`` ... with each field's docstring as its help and its default."""
    owners = {owner for owner, _ in _CLI_FIELDS}
    fields = {owner: {f.name: f for f in dataclasses.fields(owner)} for owner in owners}
    docs = {owner: field_docs(owner) for owner in owners}  # each class's source parsed once
    for owner, name in _CLI_FIELDS:
        spec = fields[owner][name]
        default = spec.default
        help_text = docs[owner][name]
        flag = "--" + name.replace("_", "-")
        if spec.type == "bool":
            parser.add_argument(flag, dest=name, action="store_true", help=help_text)
        else:
            shown = "" if default is None else f" (default {default})"
            parser.add_argument(flag, dest=name, type=_TYPES[str(spec.type)], default=default, help=help_text + shown)


def config_from_cli(options: argparse.Namespace) -> TuneConfig:
    """The :class:`TuneConfig` of parsed :func:`add_cli_options` options."""
    values = vars(options)
    trial = {name: values[name] for owner, name in _CLI_FIELDS if owner is TrialSettings}
    own = {name: values[name] for owner, name in _CLI_FIELDS if owner is TuneConfig}
    return TuneConfig(**own, settings=TrialSettings(**trial))
