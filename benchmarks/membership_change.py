"""Seconds lost per membership change of an elastic torchrun job, at two checkpoint intervals.

The fleet of ``tests/launch/test_fleet.py`` on this machine: two agents (one per "node") on a c10d rendezvous at
127.0.0.1, one worker each; at step 9 one node vanishes (agent and worker SIGKILLed), at step 13 a new one joins;
4 epochs of 6 steps. ``GoodputMonitor`` measures each change from the checkpoint the new group resumed to the step
the old group had reached, in three parts: the old group's training after that checkpoint (thrown away), the
restart (noticing the failure, re-rendezvous, starting the processes, loading) and the replay. Checkpoints every 2
and every 6 steps: a shrink loses up to an interval of work (plus its replay); a join is announced (the agents stop
their workers with SIGTERM, which save first), so it loses no work whatever the interval.

    python -m benchmarks.membership_change [--intervals 2 6] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RESULTS, save_figure, write_json
from lightning_accel.figures import pyplot
from tests.launch.test_fleet import ACCUMULATE_AT_2, EPOCHS, RECIPE, agent, free_port, kill_tree, wait_until

PARTS = ("checkpoint_to_failure_s", "restart_s", "replay_s")
KILL_AT, JOIN_AT = 9, 13  # after the first checkpoint at either interval; the join well before the end (24)


def fleet(root: Path, every_n_steps: int) -> list[dict]:
    """One run of the fleet; the changes as goodput.json records them."""
    recipe = RECIPE.format(root=root, epochs=EPOCHS, accumulate=ACCUMULATE_AT_2)
    (root / "recipe.yaml").write_text(recipe.replace("every_n_steps: 2", f"every_n_steps: {every_n_steps}"))
    progress = root / "trained" / "progress"

    def step() -> int:
        return int(progress.read_text()) if progress.exists() else -1

    port = free_port()
    a = agent(root, "a", port, hosts_store=True)
    time.sleep(0.5)
    b = agent(root, "b", port, hosts_store=False)
    wait_until(lambda: step() >= KILL_AT, f"step {KILL_AT} on two nodes", [a, b])
    kill_tree(b)
    groups = root / "trained"
    wait_until(lambda: step() >= JOIN_AT and len(list(groups.glob("*.jsonl"))) >= 3, f"step {JOIN_AT} on one", [a])
    c = agent(root, "c", port, hosts_store=False)
    if a.wait(timeout=300) != 0 or c.wait(timeout=300) != 0:
        raise SystemExit(f"the fleet failed; a.log:\n{(root / 'a.log').read_text()[-3000:]}")
    return json.loads((root / "run" / "goodput.json").read_text())["membership"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--intervals", type=int, nargs="+", default=[2, 6])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    runs: dict[str, list[list[dict]]] = {}
    for interval in args.intervals:
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                runs.setdefault(str(interval), []).append(fleet(Path(tmp), interval))
    medians = {
        interval: [
            {part: statistics.median(run[i][part] for run in rounds) for part in PARTS} for i in range(2)
        ]  # change 0: 2 -> 1, change 1: 1 -> 2
        for interval, rounds in runs.items()
    }
    result = {"epochs": EPOCHS, "steps": 6 * EPOCHS, "rounds": args.rounds, "median_parts_s": medians, "runs": runs}
    path = write_json("membership_change", result)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [
        f"every {k} steps\n{'2->1 (node lost)' if i == 0 else '1->2 (node joins)'}" for k in medians for i in (0, 1)
    ]
    bottom = [0.0] * len(labels)
    for part, color in zip(PARTS, ("#C44E52", "#4C72B0", "#DD8452"), strict=True):
        heights = [medians[k][i][part] for k in medians for i in (0, 1)]
        ax.bar(labels, heights, bottom=bottom, label=part.removesuffix("_s").replace("_", " "), color=color)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_ylabel("seconds lost")
    ax.set_title("lost per membership change (elastic torchrun, 2 CPU nodes on one machine)")
    ax.legend(fontsize=8)
    save_figure(fig, RESULTS / "membership_change.png")
    plt.close("all")
    for interval, changes in medians.items():
        shrink, join = (sum(change.values()) for change in changes)
        print(f"checkpoint every {interval} steps: node lost {shrink:.1f} s, node joins {join:.1f} s ({changes})")
    print(path)


if __name__ == "__main__":
    main()
