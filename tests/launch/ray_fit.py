"""Recipes on a real local Ray cluster (2 CPUs), one cluster for every run given: writes each run's result.

python tests/launch/ray_fit.py MAX_FAILURES RECIPE_ROOT [RECIPE_ROOT ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import ray

from lightning_accel.launch.ray import fit_on_ray


def main() -> None:
    max_failures, roots = int(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    for root in roots:
        # relative to this process's folder, as a user types it: Ray's workers start elsewhere
        args = ["--config", os.path.relpath(root / "recipe.yaml"), "--ckpt_path", "auto"]
        result = fit_on_ray(args, num_workers=2, max_failures=max_failures, storage_path=root / "ray")
        latest = None
        if result.checkpoint is not None:
            with result.checkpoint.as_directory() as folder:
                latest = json.loads((Path(folder) / "latest.json").read_text())
        summary = {
            "error": None if result.error is None else str(result.error),
            "metrics": result.metrics,
            "latest": latest,
        }
        (root / "result.json").write_text(json.dumps(summary, default=str))
    ray.shutdown()


if __name__ == "__main__":
    main()
