"""Checkpoints in a bucket, end to end: ours beside Lightning's ModelCheckpoint to s3:// and torch DCP's async_save.

Every variant in the same run, against the same S3 API server on 127.0.0.1 (moto's server mode, started here), in
alternating rounds: an MLP trained with SGD + momentum (a checkpoint of about ``--params-m`` x 8 MB: weights and
momentum), a checkpoint every ``--every`` steps.

- ``none``: the same fit without checkpoints (the reference);
- ``ours_local``: ``PreemptionCheckpoint(local folder, async_save=True)``, the stall a bucket save should match;
- ``ours_bucket``: ``PreemptionCheckpoint("s3://...", async_save=True)``: staged locally, uploaded in the
  background, confirmed, manifest last; ``fit`` returns once the last one is in the store. moto does not check the
  CRC32 sent with an upload (S3 does), so each upload is confirmed there by the MD5 in its ETag: a pass over the
  file that S3 spares us;
- ``ours_bucket_s3_path``: the same, with the fit-start probe answered as S3 answers it (the store checks CRC32s):
  the path, and the client's cost, of a fit against S3. moto only echoes the CRC32, so on moto this variant's
  confirmations are no evidence: it is here for its time;
- ``lightning_s3``: ``ModelCheckpoint(dirpath="s3://...")``, what a Lightning user picks (the write goes to the store
  on the training thread);
- ``lightning_s3_async``: the same with ``plugins=[AsyncCheckpointIO()]``;
- ``dcp_async_s3``: ``torch.distributed.checkpoint.async_save(state, checkpoint_id="s3://...")`` (DCP picks its fsspec
  writer for the URL), one save in flight.

Reported: fit time over ``none``, the start (``fit`` called to the first batch: ours probes the store there), the
stall (the saving callback's ``on_train_batch_end`` at a saving step), the tail (from the end of training,
``on_train_end``, to ``fit`` returning: the wait for the last save to reach the store), and the time to resume from
the bucket on an empty machine (find the newest checkpoint, download it, load it).

Each ``--links`` entry is a set of rounds of its own. ``local`` talks to the server on 127.0.0.1 directly: no wire at
all, so every byte sent costs CPU on the two cores that also train, and nothing can overlap a wait. ``MB_S:LATENCY_MS``
puts a modelled network between the client and the server (a proxy in a process of its own,
``tests.helpers.object_stores.Link``): that bandwidth each way shared by every connection, and that latency one way,
as between a cloud instance and its region's bucket. The PNG plots ours over the best peer for each.

``--threads 1`` trains on one of the two cores and leaves the other to the uploads, the server and the link (the
store and the network are not on a real training host's cores, and a GPU host has cores to spare). ``--gpu`` trains
on the GPU (``benchmarks/gpu_check.sh`` runs it on a lent machine), so the host's cores are left to
the uploads, the server and the link, as on a GPU node; without it training takes both of this project's CI cores.

    python -m benchmarks.object_storage [--params-m 4] [--steps 40] [--every 10] [--rounds 2] [--links local,100:10]
        [--threads 2] [--gpu] [--out FOLDER] [--name object_storage]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import fsspec
import s3fs
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from benchmarks.checkpoint_async import DCPAsyncSave, MomentumMLP, StepTimes, _time_saving_hook
from benchmarks.harness import RESULTS, quiet_trainer, save_figure, write_json
from lightning_accel import PreemptionCheckpoint, find_resume_checkpoint
from lightning_accel.checkpoint import bucket as bucket_module
from lightning_accel.demos import SyntheticClassificationDataModule
from lightning_accel.figures import pyplot
from tests.helpers.object_stores import Link, LinkProcess, MotoServer, s3_env

VARIANTS = (
    "none",
    "ours_local",
    "ours_bucket",
    "ours_bucket_s3_path",
    "lightning_s3",
    "lightning_s3_async",
    "dcp_async_s3",
)
PEERS = ("lightning_s3", "lightning_s3_async", "dcp_async_s3")
_real_probe = bucket_module.store_checks_crc32


def fit(variant: str, hidden: int, steps: int, every: int, where: str, gpu: bool = False) -> dict[str, Any]:
    timer = StepTimes()
    callbacks: list[Callback] = [timer]
    extra: dict[str, Any] = {}
    if variant.startswith("ours"):
        callbacks.append(PreemptionCheckpoint(where, every_n_steps=every, keep_last=2, async_save=True))
    elif variant.startswith("lightning"):
        callbacks.append(ModelCheckpoint(where, every_n_train_steps=every, save_top_k=2, monitor="step", mode="max"))
        extra = {"enable_checkpointing": True}
        if variant.endswith("async"):
            extra["plugins"] = [AsyncCheckpointIO()]
    elif variant == "dcp_async_s3":
        callbacks.append(DCPAsyncSave(where, every))
    stall = _time_saving_hook(callbacks[-1], every) if variant != "none" else []
    model = MomentumMLP(input_dim=hidden, hidden_dim=hidden, num_layers=3, num_classes=4)
    trainer = quiet_trainer(accelerator="gpu" if gpu else "cpu", max_steps=steps, callbacks=callbacks, **extra)
    data = SyntheticClassificationDataModule(num_samples=16 * steps, input_dim=hidden, batch_size=16)
    s3_path = variant == "ours_bucket_s3_path"
    # the probe's requests are still made (S3 answers a third: the wrong CRC32 refused, the right one taken)
    probe = mock.patch.object(bucket_module, "store_checks_crc32", lambda fs, key: _real_probe(fs, key) or True)
    start = time.perf_counter()
    with probe if s3_path else contextlib.nullcontext():
        trainer.fit(model, datamodule=data)  # each variant's teardown waits for its last write (ours: the upload)
    end = time.perf_counter()
    return {
        "fit_s": end - start,
        "start_s": timer.started_at - start,
        "stall_s": stall,
        "tail_s": end - timer.ended_at,
    }


def resume_seconds(url: str, cache: Path) -> float:
    """An empty machine: find the bucket's newest complete checkpoint, download and verify it, and load it."""
    os.environ["LIGHTNING_ACCEL_CACHE_DIR"] = str(cache)
    start = time.perf_counter()
    found = find_resume_checkpoint(url)
    assert found is not None
    torch.load(found, map_location="cpu", weights_only=False)
    return time.perf_counter() - start


def parse_link(text: str) -> Link | None:
    """``local`` (no network between client and server) or ``MB_S:LATENCY_MS``."""
    if text == "local":
        return None
    mb_s, _, latency_ms = text.partition(":")
    return Link(float(mb_s), float(latency_ms or 0))


def run(
    params_m: float = 4,
    steps: int = 40,
    every: int = 10,
    rounds: int = 2,
    link: Link | None = None,
    gpu: bool = False,
) -> dict[str, Any]:
    hidden = int((params_m * 1e6 / 3) ** 0.5)
    server = MotoServer().start()
    wire = LinkProcess(server.port, link).start() if link is not None else None
    os.environ.update(s3_env(wire.url if wire is not None else server.url))
    s3fs.S3FileSystem.clear_instance_cache()  # clients of this endpoint, not of an earlier link's
    fs = fsspec.filesystem("s3")
    fits: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    resume: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["LIGHTNING_ACCEL_CACHE_DIR"] = str(Path(tmp) / "cache")
            for r in range(rounds):
                bucket = f"bench-{r}"
                fs.mkdir(bucket)
                for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:  # alternate the order: drift cancels
                    where = str(Path(tmp) / variant) if variant == "ours_local" else f"s3://{bucket}/{variant}"
                    fits[variant].append(fit(variant, hidden, steps, every, where, gpu))
                    shutil.rmtree(Path(tmp) / variant, ignore_errors=True)
                resume.append(resume_seconds(f"s3://{bucket}/ours_bucket", Path(tmp) / f"empty-{r}"))
                os.environ["LIGHTNING_ACCEL_CACHE_DIR"] = str(Path(tmp) / "cache")
    finally:
        if wire is not None:
            wire.stop()
        server.stop()
    variants = {}
    for variant, runs in fits.items():
        stall = [t for f in runs for t in f["stall_s"]]
        paired = [f["fit_s"] / n["fit_s"] for f, n in zip(runs, fits["none"], strict=True)]
        variants[variant] = {
            "fit_s": statistics.median(f["fit_s"] for f in runs),
            "fit_over_none": statistics.median(paired),
            "start_ms": 1000 * statistics.median(f["start_s"] for f in runs),
            "stall_ms": 1000 * statistics.median(stall) if stall else 0.0,
            "tail_ms": 1000 * statistics.median(f["tail_s"] for f in runs),
        }
    best = min(PEERS, key=lambda name: variants[name]["fit_over_none"])

    raw = {v: [f["fit_s"] for f in runs] for v, runs in fits.items()}
    # each round runs every variant back to back: ours over the best peer, round by round
    over_best = {
        ours: [o / p for o, p in zip(raw[ours], raw[best], strict=True)]
        for ours in ("ours_bucket", "ours_bucket_s3_path")
    }
    return {
        "link": "local" if link is None else {"mb_s": link.mb_s, "latency_ms": link.latency_ms},
        "params_m": params_m,
        "checkpoint_mb": params_m * 8,  # fp32 weights + momentum
        "steps": steps,
        "every_n_steps": every,
        "rounds": rounds,
        "variants": variants,
        "best_peer": best,
        "ours_bucket_over_best_peer_fit": statistics.median(over_best["ours_bucket"]),
        "ours_s3_path_over_best_peer_fit": statistics.median(over_best["ours_bucket_s3_path"]),
        "ours_bucket_over_best_peer_fit_quartiles": quartiles(over_best["ours_bucket"]),
        "ours_s3_path_over_best_peer_fit_quartiles": quartiles(over_best["ours_bucket_s3_path"]),
        "ours_bucket_stall_over_ours_local": variants["ours_bucket"]["stall_ms"]
        / max(variants["ours_local"]["stall_ms"], 1e-3),
        "resume_from_bucket_s": statistics.median(resume),
        "raw_fit_s": raw,
    }


def quartiles(ratios: list[float]) -> list[float]:
    """First and third quartiles of the rounds' ratios: how far one round's ratio strays from the median, the noise a
    difference between two runs must exceed."""
    if len(ratios) < 2:
        return [ratios[0], ratios[0]]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return [q1, q3]


def link_label(text: str) -> str:
    link = parse_link(text)
    return "local" if link is None else f"{link.mb_s:g} MB/s, {link.latency_ms:g} ms"


PEER_NAMES = {"lightning_s3": "Lightning", "lightning_s3_async": "Lightning async", "dcp_async_s3": "DCP async"}


def plot(results: dict[str, dict[str, Any]], out: Path, name: str = "object_storage") -> None:
    """Ours over the best peer, fit time, for each link: on moto, and on S3's path."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels, x = list(results), range(len(results))
    for key, legend, offset in (
        ("ours_bucket_over_best_peer_fit", "ours on moto (MD5 confirmations)", -0.2),
        ("ours_s3_path_over_best_peer_fit", "ours on S3's path", 0.2),
    ):
        medians = [results[label][key] for label in labels]
        spread = [results[label][f"{key}_quartiles"] for label in labels]
        errors = [
            [m - q[0] for m, q in zip(medians, spread, strict=True)],
            [q[1] - m for m, q in zip(medians, spread, strict=True)],
        ]
        bars = ax.bar([i + offset for i in x], medians, width=0.4, label=legend, yerr=errors, capsize=3)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ticks = [f"{label}\nbest peer: {PEER_NAMES[results[label]['best_peer']]}" for label in labels]
    ax.set_xticks(list(x), ticks, fontsize=8)
    ax.set_ylim(0, 1.45)
    ax.set_ylabel("fit time, ours / best peer")
    ax.set_title(
        f"{name}: checkpoints to a bucket, by the network in between\n(median of the rounds; whiskers: quartiles)"
    )
    ax.legend(fontsize=8, loc="upper right", ncols=2)
    save_figure(fig, out / f"{name}.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-m", type=float, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--links", default="local,100:10", help="comma-separated: local, or MB_S:LATENCY_MS")
    p.add_argument("--gpu", action="store_true", help="train on the GPU (the host's cores left to the uploads)")
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads for CPU training (2: both of the CI machine's cores; 1 leaves one core to the uploads, "
        "the server and the link, as a GPU host's spare cores would be)",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    p.add_argument("--name", default="object_storage", help="their name (a variant's run beside the default one)")
    args = p.parse_args()
    links = {}
    for text in args.links.split(","):
        try:
            link = parse_link(text)
            usable = link is None or (link.mb_s > 0 and link.latency_ms >= 0)
        except ValueError:
            usable = False
        if not usable:
            p.error(f"--links: {text!r} is neither 'local' nor MB_S:LATENCY_MS with MB_S > 0 (e.g. 100:10)")
        links[link_label(text)] = link
    if args.threads < 1:
        p.error(f"--threads: {args.threads} is not a number of threads (1 or more)")
    if not args.gpu:
        torch.set_num_threads(args.threads)
    results = {}
    for label, link in links.items():
        results[label] = result = run(args.params_m, args.steps, args.every, args.rounds, link, args.gpu)
        v = result["variants"]
        print(f"-- {label}")
        for name in VARIANTS:
            row = v[name]
            print(
                f"{name:20} fit {row['fit_s']:6.2f}s  x{row['fit_over_none']:.2f}  start {row['start_ms']:6.1f} ms  "
                f"stall {row['stall_ms']:7.1f} ms  tail {row['tail_ms']:6.1f} ms"
            )
        print(
            f"ours (bucket) / best peer ({result['best_peer']}), fit: {result['ours_bucket_over_best_peer_fit']:.3f} "
            f"[quartiles {quartiles_text(result['ours_bucket_over_best_peer_fit_quartiles'])}] "
            f"(S3's path {result['ours_s3_path_over_best_peer_fit']:.3f} "
            f"[{quartiles_text(result['ours_s3_path_over_best_peer_fit_quartiles'])}]); "
            f"stall / ours local: {result['ours_bucket_stall_over_ours_local']:.2f}; "
            f"resume from the bucket on an empty machine: {result['resume_from_bucket_s']:.2f} s"
        )
    write_json(args.name, {"links": results, "threads": None if args.gpu else args.threads}, out=args.out)
    plot(results, args.out, args.name)


def quartiles_text(quartiles: list[float]) -> str:
    """``0.830-0.876``: a pair of quartiles as the printouts give them."""
    return f"{quartiles[0]:.3f}-{quartiles[1]:.3f}"


if __name__ == "__main__":
    main()
