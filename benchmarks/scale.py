"""What each rank pays as the fleet and the data grow, simulated on this machine.

- ``sentinel``: the hang sentinel's heartbeats against a real ``TCPStore`` (libuv) served by a process of its own,
  with W = 8 ... 4,096 simulated ranks spread over client processes (each rank a ``heartbeat.Watch`` on one
  connection per process), one poll a second. Reported: the store's CPU seconds per wall second (its load) for
  ``node`` (what the sentinel runs with 8 ranks a node: rank 0 judges, each node's leader alone talks to the
  store, the node's ranks meet in a folder), ``judge`` (the judge with every rank on the store) and ``replaced``
  (every rank reads every beat: the design before). The replaced one is measured for a few polls only.
- ``sampler``: ``ResumableSampler`` (a keyed permutation per index) beside torch's ``DistributedSampler`` for rank
  0 of 8, n = 10^5 ... 10^9: time to the first index, to a whole epoch's indices, and peak memory growth, each in a
  fresh process. ``DistributedSampler`` is run where its O(n) list fits in memory.
- ``verify``: ranks of one node resuming the same checkpoint (``find_resume_checkpoint``), 1, 2 and 8 processes:
  with the node's shared verdict (one rank reads the file) and with every rank reading it (the design replaced).

    python -m benchmarks.scale [--only sentinel|sampler|verify] [--ckpt-gb 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.harness import RESULTS, save_figure, write_json
from lightning_accel.figures import pyplot

WORLDS = (8, 64, 256, 1024, 4096)
SAMPLES = (10**5, 10**6, 10**7, 10**8, 10**9)
CLIENTS = 4  # client processes the simulated ranks are spread over
ROOT = Path(__file__).resolve().parents[1]


# -- the sentinel ------------------------------------------------------------------------------------------------
STORE_SERVER = """
import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(3600)
"""

CLIENT = """
import json, sys, tempfile, time
from pathlib import Path
import torch.distributed as dist
from lightning_accel.monitor.heartbeat import Beat, StoreBoard, Watch, find_hang, StallClock
from lightning_accel.monitor.node_board import NodeBoard, node_folder
from lightning_accel.monitor.sentinel import VERDICT_EVERY_S
port, world, first, count, rounds, design, start_at, folder = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
    int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], float(sys.argv[7]), Path(sys.argv[8]))
store = dist.TCPStore("127.0.0.1", port, 1, False, wait_for_workers=False)
board = StoreBoard(store, world, prefix=f"scale/{design}")

def node_board(rank):  # 8 ranks a node, each node's ranks meeting in their folder (a node's /tmp)
    node, local = divmod(rank, 8)
    return NodeBoard(store, f"scale/{design}", node_folder(folder, "job", node), rank, node, world // 8, local, 8,
                     lead_takeover_s=3600, verdict_every_s=VERDICT_EVERY_S)

boards = {r: node_board(r) if design == "node" else board for r in range(first, first + count)}
watches = [Watch(boards[r], r, world, takeover_s=3600) for r in range(first, first + count)]
clocks = {r: StallClock() for r in range(first, first + count)}

def beat(rank, n):
    return Beat(rank=rank, host="sim", pid=rank, batches=n, step=n, phase="forward", progress=n, allowance_s=600.0)

def replaced(rank, n):  # the design before the judge: every rank reads every beat each poll
    board.publish(beat(rank, n))
    store.check([f"scale/{design}/hang"])
    beats = board.read()
    find_hang(beats, clocks[rank].stalled(beats), world, rank)

late = []
while time.time() < start_at:
    time.sleep(0.001)
for n in range(rounds):
    began = time.time()
    for w in watches:
        w.poll(beat(w.rank, n)) if design != "replaced" else replaced(w.rank, n)
    took = time.time() - began
    late.append(took)
    time.sleep(max(0.0, start_at + n + 1 - time.time()))
print(json.dumps({"round_s": late}))
"""


def store_load(world: int, design: str, rounds: int) -> dict[str, Any]:
    """The store process's CPU seconds per wall second while ``world`` simulated ranks poll once a second."""
    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        proc = psutil.Process(server.pid)
        clients = min(CLIENTS, world // 8 if design == "node" else world)
        unit = 8 if design == "node" else 1  # a node's ranks stay in one client process (they share its folder)
        share = [(world // unit // clients + (i < world // unit % clients)) * unit for i in range(clients)]
        folder = tempfile.mkdtemp()
        start_at = time.time() + 8.0  # every client connected and imported
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs, first = [], 0
        for count in share:
            args = [str(port), str(world), str(first), str(count), str(rounds + 1), design, str(start_at), folder]
            procs.append(subprocess.Popen([sys.executable, "-c", CLIENT, *args], stdout=subprocess.PIPE, env=env))
            first += count
        while time.time() < start_at + 1.0:  # the first round creates the keys: measured from the second
            time.sleep(0.01)
        cpu0, wall0 = sum(proc.cpu_times()[:2]), time.time()
        outputs = [json.loads(p.communicate(timeout=3600)[0]) for p in procs]
        cpu1, wall1 = sum(proc.cpu_times()[:2]), time.time()
    finally:
        server.kill()
    slowest = max(max(o["round_s"][1:]) for o in outputs)
    # The store's CPU per poll is its load at a 1 s poll: where the simulated ranks (2 cores simulating thousands)
    # are slower than one poll a second, CPU per wall second would understate it. psutil counts in 10 ms ticks.
    return {
        "load": (cpu1 - cpu0) / rounds,
        "cpu_per_wall_s": (cpu1 - cpu0) / (wall1 - wall0),
        "slowest_round_s": slowest,
        "keeps_up": slowest <= 1.0,
    }


def sentinel(rounds: int, designs: list[str], result: dict[str, Any]) -> dict[str, Any]:
    """Each design's store load by world size, into ``result`` (a previous run's, for the designs not rerun)."""
    for design in designs:
        for world in WORLDS:
            if design == "replaced" and world > 1024:
                continue  # W^2 keys a poll: one poll would take minutes
            result[f"{design}/{world}"] = store_load(world, design, rounds if design != "replaced" else 3)
            print(design, world, result[f"{design}/{world}"], flush=True)
    return result


# -- the sampler -------------------------------------------------------------------------------------------------
SAMPLER = """
import json, resource, sys, time, psutil
from torch.utils.data import DistributedSampler
from lightning_accel.data import ResumableSampler
kind, n, whole = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
base = psutil.Process().memory_info().rss
began = time.perf_counter()
if kind == "ours":
    sampler = ResumableSampler(range(n), seed=1, num_replicas=8, rank=0, batch_size=32)
else:
    sampler = DistributedSampler(range(n), num_replicas=8, rank=0, shuffle=True, seed=1)
sampler.set_epoch(1)
it = iter(sampler)
next(it)
first = time.perf_counter() - began
count = 1 + sum(1 for _ in it) if whole else None
epoch = time.perf_counter() - began if whole else None
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"first_s": first, "epoch_s": epoch, "indices": count, "growth_mb": (peak - base) / 2**20}))
"""


def sampler_run(kind: str, n: int, whole: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", SAMPLER, kind, str(n), "1" if whole else "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout)


def sampler() -> dict[str, Any]:
    result: dict[str, Any] = {}
    for n in SAMPLES:
        for kind in ("ours", "torch"):
            if kind == "torch" and n > 10**8:
                continue  # torch.randperm(10^9).tolist(): tens of GB
            result[f"{kind}/{n}/first"] = sampler_run(kind, n, whole=False)
            if n <= 10**7 or (kind == "ours" and n <= 10**8):
                result[f"{kind}/{n}/epoch"] = sampler_run(kind, n, whole=True)
            print(kind, n, {k: v for k, v in result.items() if k.startswith(f"{kind}/{n}/")}, flush=True)
    return result


# -- resume verification -----------------------------------------------------------------------------------------
VERIFY = """
import sys, time
from pathlib import Path
from lightning_accel.checkpoint import find_resume_checkpoint
from lightning_accel.checkpoint.verify import verify
print("ready", flush=True)
sys.stdin.readline()  # every rank imported: go
began = time.perf_counter()
if sys.argv[2] == "shared":
    find_resume_checkpoint(sys.argv[1])
else:  # the design replaced: each rank reads and checksums the file itself
    verify(next(Path(sys.argv[1]).glob("*.ckpt")))
print(time.perf_counter() - began, flush=True)
"""


def verify(ckpt_gb: float) -> dict[str, Any]:
    import torch

    from lightning_accel.checkpoint import atomic_save

    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        atomic_save({"state_dict": {"w": torch.zeros(int(ckpt_gb * 2**30 / 4))}}, Path(folder) / "step=00000001.ckpt")
        for shared in (True, False):
            for ranks in (1, 2, 8):
                cache = tempfile.mkdtemp()  # each run starts with no verdict on the node
                env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_ACCEL_CACHE_DIR": cache}
                cmd = [sys.executable, "-c", VERIFY, folder, "shared" if shared else "every_rank"]
                procs = [
                    subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
                    for _ in range(ranks)
                ]
                for p in procs:  # imports are not what is measured: start together once every rank is ready
                    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
                for p in procs:
                    assert p.stdin is not None
                    p.stdin.write("go\n")
                    p.stdin.flush()
                times = [float(p.communicate()[0]) for p in procs]
                result[f"{'shared' if shared else 'every_rank'}/{ranks}"] = {"all_done_s": max(times)}
                print(shared, ranks, max(times), flush=True)
    return result


# -- report ------------------------------------------------------------------------------------------------------
def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    sent = result.get("sentinel", {})
    designs = (
        ("node", "judge + one store client a node (ours, 8 ranks a node)"),
        ("judge", "judge, every rank its own key"),
        ("replaced", "every rank reads every beat (before)"),
    )
    for design, label in designs:
        xs = [w for w in WORLDS if f"{design}/{w}" in sent]
        axes[0].plot(xs, [sent[f"{design}/{w}"]["load"] for w in xs], marker="o", label=label)
    axes[0].axhline(0.05, color="grey", linestyle=":", label="target 0.05")
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="ranks W",
        ylabel="store CPU s per s (1 s poll)",
        title="hang sentinel: store load",
    )
    samp = result.get("sampler", {})
    for kind, label in (("ours", "ResumableSampler"), ("torch", "DistributedSampler")):
        xs = [n for n in SAMPLES if "first_s" in samp.get(f"{kind}/{n}/first", {})]
        axes[1].plot(xs, [samp[f"{kind}/{n}/first"]["first_s"] for n in xs], marker="o", label=f"{label}: first index")
        xs = [n for n in SAMPLES if "epoch_s" in samp.get(f"{kind}/{n}/epoch", {})]
        axes[1].plot(
            xs,
            [samp[f"{kind}/{n}/epoch"]["epoch_s"] for n in xs],
            marker="s",
            linestyle="--",
            label=f"{label}: rank 0's epoch",
        )
    axes[1].set(xscale="log", yscale="log", xlabel="samples n", ylabel="seconds (rank 0 of 8)", title="sampler")
    ver = result.get("verify", {})
    for mode, label in (("shared", "node verdict (ours)"), ("every_rank", "every rank reads")):
        xs = [r for r in (1, 2, 8) if f"{mode}/{r}" in ver]
        axes[2].plot(xs, [ver[f"{mode}/{r}"]["all_done_s"] for r in xs], marker="o", label=label)
    axes[2].set(
        xlabel="ranks on the node",
        ylabel="seconds until every rank has verified",
        title=f"resume verification ({result.get('ckpt_gb')} GB)",
    )
    for ax in axes:
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("sentinel", "sampler", "verify"))
    parser.add_argument("--rounds", type=int, default=6, help="polls measured per world size (judge design)")
    parser.add_argument("--ckpt-gb", type=float, default=2.0)
    parser.add_argument("--designs", default="node,judge,replaced", help="sentinel designs to measure")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    previous = args.out / "scale.json"
    result: dict[str, Any] = json.loads(previous.read_text()) if args.only and previous.exists() else {}
    result["ckpt_gb"] = args.ckpt_gb if args.only in (None, "verify") else result.get("ckpt_gb")
    if args.only in (None, "sentinel"):
        result["sentinel"] = sentinel(args.rounds, args.designs.split(","), result.get("sentinel", {}))
    if args.only in (None, "sampler"):
        result["sampler"] = sampler()
    if args.only in (None, "verify"):
        result["verify"] = verify(args.ckpt_gb)
    result.pop("benchmark", None), result.pop("environment", None)
    write_json("scale", result, args.out)
    plot(result, args.out / "scale.png")


if __name__ == "__main__":
    main()
