"""A spot fleet on one machine: two torchrun agents (one per "node") on a c10d rendezvous at 127.0.0.1, one
vanishes mid-run (agent and worker killed), a new one joins later; and the same on a local Ray cluster of two
raylets under Ray Train's elastic scaling. Each run finishes with every sample of every epoch trained once, in the
global order, and the two membership changes are in the log and the ledger."""

from __future__ import annotations

import ast
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lightning_accel.data import ResumableSampler
from tests.launch.elastic_fleet import BATCH, SAMPLES, SEED, step_reached, world_sizes

ROOT = Path(__file__).resolve().parents[2]
EPOCHS, ACCUMULATE_AT_2 = 4, 2
STEPS_PER_EPOCH = SAMPLES // BATCH // (2 * ACCUMULATE_AT_2)
TIMEOUT = 180
RECIPE = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  strategy: ddp
  max_epochs: {epochs}
  accumulate_grad_batches: {accumulate}
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  logger: false
  callbacks:
    - class_path: lightning_accel.PreemptionCheckpoint
      init_args: {{dirpath: {root}/ckpt, every_n_steps: 2, keep_last: 3}}
    - class_path: lightning_accel.GoodputMonitor
      init_args: {{run_dir: {root}/run, progress_every_n_seconds: 0}}
    - class_path: tests.launch.elastic_fleet.Record
      init_args: {{folder: {root}/trained, delay_s: 0.12}}
model:
  class_path: tests.launch.elastic_fleet.FleetNet
data:
  class_path: tests.launch.elastic_fleet.FleetData
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(root: Path, name: str, port: int, hosts_store: bool) -> subprocess.Popen:
    """One node: `lightning-accel torchrun --nnodes 1:2` with one worker. The first hosts the rendezvous store (as a
    node that stays, or an etcd server, would); the keep-alive is short so a vanished node is noticed in seconds."""
    conf = f"last_call_timeout=5,join_timeout=60,keep_alive_interval=2,keep_alive_max_attempt=2,is_host={hosts_store}"
    cmd = [sys.executable, "-m", "lightning_accel.cli", "torchrun", "--nnodes", "1:2", "--nproc-per-node", "1"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fleet"]
    cmd += ["--rdzv-conf", conf, "--max-restarts", "3", "--monitor-interval", "0.2"]
    cmd += ["fit", "--config", str(root / "recipe.yaml"), "--ckpt_path", "auto"]
    log = open(root / f"{name}.log", "w")  # the agent writes it until it ends
    return subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_until(condition, what: str, agents: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            for proc in agents:
                kill_tree(proc)
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def kill_tree(proc: subprocess.Popen) -> None:
    """The node vanishes: its agent and its workers, SIGKILL, nothing saved."""
    try:
        parent = psutil.Process(proc.pid)
        for p in [parent, *parent.children(recursive=True)]:
            p.kill()
    except psutil.NoSuchProcess:
        pass
    proc.wait(timeout=30)


def effective_batches(folder: Path) -> dict[int, list[list[int]]]:
    """Each optimizer step's micro-batches as the run kept them: a group that resumed at step s replaces what any
    earlier group trained from s on (that work was lost with it)."""
    records = [json.loads(line) for path in folder.glob("*.jsonl") for line in path.read_text().splitlines()]
    kept: dict[int, list[list[int]]] = {}
    for start, world in sorted({(r["from_step"], r["world_size"]) for r in records}):
        kept = {step: batches for step, batches in kept.items() if step < start}
        for r in records:
            if (r["from_step"], r["world_size"]) == (start, world):
                kept.setdefault(r["step"], []).append(r["ids"])
    return {step: sorted(batches) for step, batches in sorted(kept.items())}


def expected_batches(epochs: int = EPOCHS) -> dict[int, list[list[int]]]:
    """The global order, 4 slots of BATCH a step (2 ranks x 2 accumulated, or 1 rank x 4)."""
    sampler, expected = ResumableSampler(range(SAMPLES), seed=SEED, batch_size=BATCH), {}
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        slots = sampler.global_slots()
        for k in range(STEPS_PER_EPOCH):
            expected[epoch * STEPS_PER_EPOCH + k] = sorted(slots[4 * k : 4 * k + 4])
    return expected


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_node_vanishes_and_another_joins_and_every_sample_is_trained_once(tmp_path):
    recipe = RECIPE.format(root=tmp_path, epochs=EPOCHS, accumulate=ACCUMULATE_AT_2)
    # the rank left alone holds at step 10 (a checkpoint at world size 1 is saved by then) until node c joins
    recipe = recipe.replace("delay_s: 0.12}", "delay_s: 0.12, hold_from_step: 10}")
    assert "hold_from_step" in recipe
    (tmp_path / "recipe.yaml").write_text(recipe)
    trained = tmp_path / "trained"

    port = free_port()
    a = agent(tmp_path, "a", port, hosts_store=True)
    time.sleep(0.5)
    b = agent(tmp_path, "b", port, hosts_store=False)
    wait_until(lambda: step_reached(trained) >= 5, "step 5 on two nodes", [a, b])
    kill_tree(b)
    wait_until(lambda: 1 in world_sizes(trained) and step_reached(trained) >= 8, "step 8 on the node that stayed", [a])
    c = agent(tmp_path, "c", port, hosts_store=False)
    for proc in (a, c):
        try:
            assert proc.wait(timeout=TIMEOUT) == 0, (tmp_path / "a.log").read_text()[-3000:]
        except subprocess.TimeoutExpired:
            for stuck in (a, c):
                kill_tree(stuck)
            pytest.fail("the fleet did not finish; a.log:\n" + (tmp_path / "a.log").read_text()[-3000:])
    assert effective_batches(trained) == expected_batches()  # every sample of every epoch once, in the global order
    logs = (tmp_path / "a.log").read_text() + (tmp_path / "c.log").read_text()
    assert "2 -> 1 rank(s), accumulate_grad_batches 2 -> 4" in logs
    assert "1 -> 2 rank(s), accumulate_grad_batches 4 -> 2" in logs
    results = json.loads((tmp_path / "run" / "goodput.json").read_text())
    assert results["goodput/membership_changes"] == 2.0
    assert results["goodput/membership_lost_s"] >= results["goodput/last_change_lost_s"] > 0
    assert "membership change 1" in logs and "membership change 2" in logs  # the summary, one row each
    assert [(c["before"], c["after"]) for c in results["membership"]] == [(2, 1), (1, 2)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ray_trains_on_when_a_node_vanishes_and_grows_back_when_one_joins(tmp_path):
    """``lightning-accel fit --ray.num_workers 1:2`` on a Ray cluster of two one-CPU nodes (tests/launch/ray_fleet.py):
    the second node is removed at step 5 (its worker dies), Ray restarts the group on the one node left, which resumes
    our checkpoint at world size 1; a node added at step 6 makes Ray's elastic policy grow the group back to 2, which
    resumes at 2. Every optimizer step trains the global order's 4 micro-batches; the ledger has both changes."""
    pytest.importorskip("ray.train", reason="Ray Train is the optional [ray] extra (make test installs it)")
    epochs = 4
    recipe = RECIPE.format(root=tmp_path, epochs=epochs, accumulate=ACCUMULATE_AT_2)
    # the worker left alone holds at step 8 (its checkpoint saved) until Ray regroups for the node added at step 6
    recipe = recipe.replace("delay_s: 0.12}", "delay_s: 0.2, hold_from_step: 8}")
    assert "hold_from_step" in recipe
    (tmp_path / "recipe.yaml").write_text(recipe)
    script = [sys.executable, str(ROOT / "tests/launch/ray_fleet.py"), str(tmp_path), "5", "6"]
    result = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    log = (tmp_path / "fit.log").read_text() if (tmp_path / "fit.log").exists() else ""
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:] + log[-4000:]
    assert effective_batches(tmp_path / "trained") == expected_batches(epochs)
    assert "2 -> 1 rank(s), accumulate_grad_batches 2 -> 4" in log
    assert "Deciding to resize the worker group from 1 -> 2 workers" in log  # Ray's elastic policy grew it
    assert "1 -> 2 rank(s), accumulate_grad_batches 4 -> 2" in log
    results = json.loads((tmp_path / "run" / "goodput.json").read_text())
    assert [(c["before"], c["after"]) for c in results["membership"]] == [(2, 1), (1, 2)]
    assert results["goodput/membership_lost_s"] >= results["goodput/last_change_lost_s"] > 0
    # RayReport sent our metrics to Ray (the ledger's included) and a Ray checkpoint naming our newest file
    steps = epochs * STEPS_PER_EPOCH
    finished = ast.literal_eval(re.search(r"Ray Train run finished: (\{.*\})", log).group(1))
    assert finished["step"] == steps and finished["goodput/membership_changes"] == 2
    newest = {"path": str(tmp_path / "ckpt" / f"step={steps:08d}.ckpt"), "global_step": steps}
    assert f"newest checkpoint: {newest}" in log
