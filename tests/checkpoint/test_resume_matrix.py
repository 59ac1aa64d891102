"""Exact resume in realistic training: the conformance matrix of tests/checkpoint/resume_matrix.py.

Each case runs one subprocess holding several scenarios (stop points, one or three interruptions in a
row) against one uninterrupted reference run, with a model defined there (BatchNorm, Dropout, AdamW,
per-step and per-epoch schedules, a validation step that uses the RNG). The configurations cover every
pair of (accumulation 1/3, validation off/on, ResumableDataLoader/StatefulDataLoader/DALI CPU,
sync/async writes), plus 2-rank DDP on gloo with the signal sent to rank 1 only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_accel.checkpoint import PREEMPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/checkpoint/resume_matrix.py"

EVERY = ["first_step", "mid_epoch_then_after_resume", "epoch_end", "three_in_a_row"]
WITH_VALIDATION = ["before_validation", "during_validation", "sanity_check"]
WITH_ACCUMULATION = ["inside_accumulation"]


def scenarios(accumulate: int, val: bool) -> list[str]:
    return EVERY + (WITH_VALIDATION if val else []) + (WITH_ACCUMULATION if accumulate > 1 else [])


# (loader, accumulate, validation, async_save, devices, workers): all pairs of the first four are covered; the
# configs with workers also augment in __getitem__ (random noise and flips, seeded per sample).
CONFIGS = [
    ("resumable", 1, False, False, 1, 0),
    ("resumable", 3, True, True, 1, 0),
    ("stateful", 1, True, True, 1, 0),
    ("stateful", 3, False, False, 1, 0),
    ("dali", 1, True, False, 1, 0),
    ("dali", 3, False, True, 1, 0),
    ("resumable", 3, True, False, 2, 0),
    ("dali", 1, True, True, 2, 0),
    ("stateful", 1, True, True, 2, 0),  # StatefulDistributedSampler, as docs/checkpointing.md says
    ("resumable", 1, True, True, 1, 2),
    ("stateful", 3, True, False, 1, 2),  # PerSampleSeed + tag_epochs, as docs/checkpointing.md says
]


def matrix_config(loader: str, accumulate: int, val: bool, async_save: bool, devices: int, workers: int) -> dict:
    return {
        "loader": loader,
        "accumulate": accumulate,
        "val": val,
        "async_save": async_save,
        "devices": devices,
        "workers": workers,
        "augment": workers > 0,
        "scenarios": scenarios(accumulate, val),
    }


@pytest.fixture(scope="module")
def matrix_results(tmp_path_factory) -> dict[tuple, dict[int, dict]]:
    """Every config's results by rank: one subprocess runs all one-process configs in turn, one 2-rank DDP launch
    all 2-rank ones (each config's attempts already run as fresh fits in one process, as a sweep would)."""
    results = {}
    for devices in sorted({c[4] for c in CONFIGS}):
        group = [c for c in CONFIGS if c[4] == devices]
        out = tmp_path_factory.mktemp(f"matrix{devices}")
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), json.dumps([matrix_config(*c) for c in group]), str(out)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        for i, config in enumerate(group):
            results[config] = {
                r: json.loads((out / str(i) / f"result_rank{r}.json").read_text()) for r in range(devices)
            }
    return results


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("loader", "accumulate", "val", "async_save", "devices", "workers"), CONFIGS, ids=lambda v: str(v)
)
def test_interrupted_runs_end_bitwise_equal_to_the_uninterrupted_run(
    matrix_results, loader, accumulate, val, async_save, devices, workers
):
    results = matrix_results[(loader, accumulate, val, async_save, devices, workers)]
    for rank, by_scenario in results.items():
        assert sorted(by_scenario) == sorted(scenarios(accumulate, val))
        for name, r in by_scenario.items():
            where = f"rank {rank}, scenario {name}"
            interruptions = len(r["codes"]) - 1
            assert interruptions == (
                3 if name == "three_in_a_row" else 2 if name == "mid_epoch_then_after_resume" else 1
            ), where
            assert r["codes"] == [PREEMPTED_EXIT_CODE] * interruptions + [0], where
            assert r["differences"] == [], f"{where}: differs from the uninterrupted run in {r['differences'][:5]}"
            assert r["epoch_values"] == r["reference_epoch_values"], f"{where}: epoch values differ"
            # 3 epochs x (train_loss, accuracy), and a validation every 9 batches when it is on
            assert len(r["reference_epoch_values"]) == 6 + (36 // 9 if val else 0), where
            assert r["seen_equal"], (
                f"{where}: trained samples differ from sample {r['seen_first_mismatch']} on ({r['seen_lengths']})"
            )
