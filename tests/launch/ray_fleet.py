"""A spot fleet on Ray: a local cluster of two "nodes" (Ray's own ``cluster_utils.Cluster``, each a raylet with one
CPU on this machine) runs ``lightning-accel fit --ray.num_workers 1:2`` (an elastic Ray Train group of 1 to 2
workers). The second node is removed once the run reached step REMOVE_AT on two workers (its worker dies with it),
and a new node is added once the group that is left trained to step ADD_AT on one; Ray's elastic policy grows the
group back to two. Exits with the command's exit status.

python tests/launch/ray_fleet.py ROOT REMOVE_AT ADD_AT

ROOT holds recipe.yaml (the fleet test's, recording every micro-batch under ROOT/trained); the command's output goes
to ROOT/fit.log. Cluster nodes are added and removed from this process's main thread, as Ray requires.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.launch.elastic_fleet import step_reached, world_sizes

# Read by Ray's train controller, which the cluster's raylets start: set before they are. A lost node is noticed in
# about 1.5 s (health checks every 0.5 s), and a group that cannot start at the size Ray first counted gives up after
# 8 s instead of 60, so the test does not wait on Ray's defaults for clusters of real machines.
os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "8"
# Two of Ray Train's helper actors (a Python process each, every time the group starts: three times here) watch
# what this cluster has not got: a cloud's drain notices (ours are PreemptionNotices') and a metrics backend.
os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
os.environ["RAY_TRAIN_METRICS_ENABLED"] = "0"
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
TIMEOUT = 480  # per wait: a loaded 2-core machine has taken 6 min from the cluster's start to the first step
# Ray Train's elastic policy reads the cluster's resources through Ray's AutoscalingCoordinator actor, which refreshes
# its view every 20 s (its TICK_INTERVAL_S, no setting). After the node is removed, a stale view has the controller
# try a group of 2 that cannot start, again and again, for up to 20 s; a node added is seen up to 20 s late. The
# fleet's driver creates that named actor first, refreshing every second, so the test waits on the run rather than
# on the tick (a test-only setting, like the health checks above; Ray's own code runs unchanged).
TICK_INTERVAL_S = 1


def start_coordinator() -> None:
    """Ray's AutoscalingCoordinator under its own name (the controller finds it: get_if_exists), ticking faster."""
    import ray
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator

    class FastTickCoordinator(coordinator._AutoscalingCoordinatorActor):
        pass

    FastTickCoordinator.TICK_INTERVAL_S = TICK_INTERVAL_S
    options = {"name": "AutoscalingCoordinator", "namespace": "AutoscalingCoordinator", "lifetime": "detached"}
    actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(FastTickCoordinator)
    actor.options(**options, get_if_exists=True).remote()


def wait_until(condition, what: str, fit: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if fit.poll() is not None or time.monotonic() > deadline:
            fit.kill()
            raise SystemExit(f"ray_fleet: the run ended or timed out waiting for {what}")
        time.sleep(0.2)


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    root, remove_at, add_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    trained = root / "trained"
    head = {"num_cpus": 1, "include_dashboard": False, "_system_config": SYSTEM_CONFIG}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    node = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    start_coordinator()
    command = [sys.executable, "-m", "lightning_accel.cli", "fit", "--config", str(root / "recipe.yaml")]
    command += ["--ckpt_path", "auto", "--ray.num_workers", "1:2", "--ray.max_failures", "3"]
    command += ["--ray.resize_check_s", "2", "--ray.storage_path", str(root / "ray")]
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    with open(root / "fit.log", "w") as log:
        fit = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: step_reached(trained) >= remove_at and 2 in world_sizes(trained), "two workers", fit)
            cluster.remove_node(node)  # the node vanishes: its raylet and the worker on it die
            print(f"ray_fleet: node removed at step {step_reached(trained)}", flush=True)
            wait_until(lambda: 1 in world_sizes(trained) and step_reached(trained) >= add_at, "one worker", fit)
            cluster.add_node(num_cpus=1)  # a node joins; Ray's elastic policy sees it at its next look
            print(f"ray_fleet: node added at step {step_reached(trained)}", flush=True)
            code = fit.wait(timeout=TIMEOUT)
        finally:
            if fit.poll() is None:
                fit.kill()
            ray.shutdown()
            cluster.shutdown()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
