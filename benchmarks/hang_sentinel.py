"""HangSentinel: its cost per step on 2 gloo ranks, side by side with it off, and the time from a hang to the exit.

Overhead: the tiny GPT on 2 DDP ranks (one torchrun job), fits with and without the sentinel in alternating
rounds; steady-state seconds per step (steps 10 to the last) as the median of rounds, and the time spent inside the
sentinel's own hooks per step (the resolvable number on a noisy 2-core machine), plus one watchdog poll (publish
this rank's beat, read both, check for a posted hang) on the job's TCPStore. Hang to exit: rank 1 sleeps forever
inside ``training_step``; the seconds from that moment until torchrun has ended both ranks, against the allowance
(``floor_s``). Without a sentinel the job waits for the collective timeout: 30 min with gloo, 10 with NCCL.

    python -m benchmarks.hang_sentinel [--steps 60] [--rounds 5] [--hangs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from benchmarks.harness import write
from lightning_accel.demos import SyntheticTokenDataModule, TinyGPT
from lightning_accel.monitor import HangSentinel
from lightning_accel.testing import quiet_trainer_kwargs

WARM = 10
FLOOR_S = 2.0


class Clock(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == WARM:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


class TimedSentinel(HangSentinel):
    """The sentinel, with the time spent inside its training hooks added up."""

    spent = 0.0


def _timed(name: str):
    inner = getattr(HangSentinel, name)

    def hook(self, *args, **kwargs):
        start = time.perf_counter()
        inner(self, *args, **kwargs)
        TimedSentinel.spent += time.perf_counter() - start

    return hook


for _hook in ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end"):
    setattr(TimedSentinel, _hook, _timed(_hook))


class HangsAtStep(TinyGPT):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 8:
            Path(os.environ["HANG_MARK"]).write_text(str(time.time()))
            while True:
                time.sleep(1)
        return super().training_step(batch, batch_idx)


def fit(steps: int, sentinel: HangSentinel | None, model_class: type = TinyGPT) -> Clock:
    seed_everything(0)
    clock = Clock()
    callbacks = [clock, *([sentinel] if sentinel is not None else [])]
    kwargs = quiet_trainer_kwargs(
        accelerator="cpu",
        devices=2,
        strategy="accel_ddp",
        max_steps=steps,
        callbacks=callbacks,
        default_root_dir=os.environ.get("RUN_DIR", "."),  # a hang's dumps go to RUN_DIR/hang/
    )
    Trainer(**kwargs).fit(model_class(), SyntheticTokenDataModule(batch_size=8, seq_len=64))
    return clock


def worker(args: argparse.Namespace) -> None:
    """One rank of the torchrun job."""
    torch.set_num_threads(1)
    if args.hang:
        fit(100, HangSentinel(floor_s=FLOOR_S, factor=10, startup_s=120), HangsAtStep)
        return
    per_step: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for config in ("off", "on") if r % 2 == 0 else ("on", "off"):
            TimedSentinel.spent = 0.0
            sentinel = TimedSentinel() if config == "on" else None
            clock = fit(args.steps, sentinel)
            per_step[config].append((clock.end - clock.start) / (args.steps - WARM))
            if sentinel is not None:
                per_step.setdefault("hook_us", []).append(1e6 * TimedSentinel.spent / args.steps)
                if int(os.environ["RANK"]) == 0:
                    per_step.setdefault("poll_us", []).append(1e6 * poll_seconds(sentinel))
    if int(os.environ["RANK"]) == 0:
        Path(args.out).write_text(json.dumps(per_step))


def poll_seconds(sentinel: HangSentinel) -> float:
    """One judging watchdog cycle on the job's store, after the fit (the store is still up): publish, read every
    beat, post the verdict (rank 0's; the others only publish and read the verdict)."""
    import torch.distributed as dist

    from lightning_accel._compat import default_store
    from lightning_accel.monitor.heartbeat import StoreBoard, Watch

    watch = Watch(StoreBoard(default_store(), dist.get_world_size(), prefix="benchmark"), 0, dist.get_world_size())
    beat = sentinel.beat()
    start = time.perf_counter()
    for _ in range(100):
        watch.poll(beat)
    return (time.perf_counter() - start) / 100


def torchrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "benchmarks.hang_sentinel"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env={**os.environ, **(env or {})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hangs", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hang", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "overhead.json"
        run = torchrun("--worker", "--steps", str(args.steps), "--rounds", str(args.rounds), "--out", str(out))
        if run.returncode != 0:
            raise SystemExit(run.stderr[-3000:])
        per_step = json.loads(out.read_text())
        to_exit = []
        for i in range(args.hangs):
            mark = Path(tmp) / f"hang{i}"
            run = torchrun("--worker", "--hang", env={"HANG_MARK": str(mark), "RUN_DIR": tmp})
            ended = time.time()
            if "exitcode  : 76" not in run.stderr:
                raise SystemExit(f"the hang did not end with the sentinel's exit code:\n{run.stderr[-3000:]}")
            to_exit.append(ended - float(mark.read_text()))
    off, on = statistics.median(per_step["off"]), statistics.median(per_step["on"])
    hook_us, poll_us = statistics.median(per_step["hook_us"]), statistics.median(per_step["poll_us"])
    result = {
        "steps": args.steps,
        "rounds": args.rounds,
        "ms_per_step_off": 1000 * off,
        "ms_per_step_on": 1000 * on,
        "ratio_on_over_off": on / off,
        "sentinel_hooks_us_per_step": hook_us,
        "sentinel_hooks_share_of_step": hook_us / (1e6 * off),
        "watchdog_poll_us": poll_us,
        "watchdog_share_of_a_core_at_1_poll_per_s": poll_us / 1e6,
        "floor_s": FLOOR_S,
        "hang_to_exit_s": to_exit,
        "hang_to_exit_median_s": statistics.median(to_exit),
        "without_sentinel_s": {"gloo default timeout": 1800, "nccl default timeout": 600},
        "all_rounds_s_per_step": per_step,
    }
    values = {
        "step off (ms)": 1000 * off,
        "step on (ms)": 1000 * on,
        "hooks (us/step)": hook_us,
        "hang->exit (s)": statistics.median(to_exit),
    }
    path = write("hang_sentinel", result, values, "see labels")
    print(
        f"{path}: {1000 * off:.2f} ms/step off, {1000 * on:.2f} on ({on / off:.3f}x); hooks {hook_us:.1f} us/step "
        f"({hook_us / (1e6 * off):.4%} of a step); one watchdog poll {poll_us:.0f} us; hang to exit "
        f"{statistics.median(to_exit):.1f} s (allowance {FLOOR_S} s) instead of up to 1800 s"
    )


if __name__ == "__main__":
    main()
