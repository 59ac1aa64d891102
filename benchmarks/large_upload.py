"""One large checkpoint into a bucket: the time until it counts, ours beside Lightning's write to s3://.

A checkpoint of two parts' worth or more (``PART_BYTES``, 50 MB) goes up through s3fs in parts, and ours is only done
once the store reports it with the staged file's checksum: the S3 multipart ETag, an MD5 over the whole file. Every
variant in the same run, against the same S3 API server on 127.0.0.1 (moto's server mode, started here), in
alternating rounds:

- ``lightning``: ``fs.pipe_file`` of the checkpoint's bytes with s3fs's default client, what Lightning's
  ``ModelCheckpoint(dirpath="s3://...")`` does with a serialized checkpoint (and nothing confirms what the store kept);
- ``ours_md5_after``: ours before the MD5 went beside the send: s3fs's ``put_file`` of the staged file, then the MD5
  read from the file, then compared with the ETag;
- ``ours``: ``lightning_accel.storage.upload`` as it is: the MD5 computed on a thread of its own while the parts are
  sent.

Each ``--links`` entry is a set of rounds of its own (``local``, or ``MB_S:LATENCY_MS`` through the modelled network
of ``benchmarks/object_storage.py``). Reported: each variant's median seconds and MB/s, and ours over each of the other
two, round by round (the median of the rounds' ratios and their quartiles).

    python -m benchmarks.large_upload [--mb 256] [--rounds 3] [--links local,300:10]
        [--out FOLDER] [--name large_upload]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import s3fs

from benchmarks.harness import RESULTS, save_figure, write_json
from benchmarks.object_storage import link_label, parse_link, quartiles, quartiles_text
from lightning_accel.figures import pyplot
from lightning_accel.storage import for_uploads, transfer
from tests.helpers.object_stores import Link, LinkProcess, MotoServer, s3_env

VARIANTS = ("lightning", "ours_md5_after", "ours")


def _variants(staged: Path, bucket: str) -> dict[str, Callable[[str], None]]:
    default = fsspec.filesystem("s3")
    ours = for_uploads(default)

    def lightning(key: str) -> None:
        default.pipe_file(f"{bucket}/{key}", staged.read_bytes())

    def ours_md5_after(key: str) -> None:
        ours.put_file(str(staged), f"{bucket}/{key}", chunksize=transfer.PART_BYTES)
        transfer.confirm_upload(ours, f"{bucket}/{key}", staged)

    return {
        "lightning": lightning,
        "ours_md5_after": ours_md5_after,
        "ours": lambda key: transfer.upload(ours, staged, f"{bucket}/{key}"),
    }


def run(mb: int, rounds: int, link: Link | None) -> dict[str, Any]:
    server = MotoServer().start()
    wire = LinkProcess(server.port, link).start() if link is not None else None
    os.environ.update(s3_env(wire.url if wire is not None else server.url))
    s3fs.S3FileSystem.clear_instance_cache()  # clients of this endpoint, not of an earlier link's
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            staged = Path(tmp) / "step=00000100.ckpt"
            staged.write_bytes(os.urandom(mb * 2**20))
            fsspec.filesystem("s3").mkdir("bench")
            variants = _variants(staged, "bench")
            for r in range(rounds):
                for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:  # alternate the order: drift cancels
                    start = time.perf_counter()
                    variants[name](f"{name}-{r}.ckpt")
                    seconds[name].append(time.perf_counter() - start)
                    fsspec.filesystem("s3").rm_file(f"bench/{name}-{r}.ckpt")  # the server keeps objects in memory
    finally:
        if wire is not None:
            wire.stop()
        server.stop()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    result: dict[str, Any] = {
        "mb": mb,
        "rounds": rounds,
        "seconds": median,
        "mb_per_s": {name: mb * 2**20 / 1e6 / s for name, s in median.items()},
        "raw_s": seconds,
    }
    for peer in ("lightning", "ours_md5_after"):  # round by round: the variants of a round ran back to back
        ratios = [o / p for o, p in zip(seconds["ours"], seconds[peer], strict=True)]
        result[f"ours_over_{peer}"] = statistics.median(ratios)
        result[f"ours_over_{peer}_quartiles"] = quartiles(ratios)
    return result


def plot(results: dict[str, dict[str, Any]], out: Path, name: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = list(results)
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        xs = [j + (i - 1) * width for j in range(len(labels))]
        bars = ax.bar(xs, [results[label]["seconds"][variant] for label in labels], width=width, label=variant)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("seconds until it is in the store")
    mb = next(iter(results.values()))["mb"]
    ax.set_title(f"{name}: one {mb} MiB checkpoint to a bucket\n(median of the rounds, by the network in between)")
    ax.legend(fontsize=8)
    save_figure(fig, out / f"{name}.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=256, help="the checkpoint's size in MiB (two 50 MB parts' worth or more)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--links", default="local,300:10", help="comma-separated: local, or MB_S:LATENCY_MS")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    p.add_argument("--name", default="large_upload")
    args = p.parse_args()
    if args.mb * 2**20 < 2 * transfer.PART_BYTES:
        p.error(f"--mb: {args.mb} MiB goes up in one PutObject; give {2 * transfer.PART_BYTES // 2**20} or more")
    if args.rounds < 1:
        p.error(f"--rounds: {args.rounds} is not a number of rounds (1 or more)")
    results = {}
    for text in args.links.split(","):
        try:
            link = parse_link(text)
        except ValueError:
            p.error(f"--links: {text!r} is neither 'local' nor MB_S:LATENCY_MS (e.g. 300:10)")
        label = link_label(text)
        results[label] = result = run(args.mb, args.rounds, link)
        s = result["seconds"]
        print(f"-- {label}: " + "  ".join(f"{v} {s[v]:.2f} s ({result['mb_per_s'][v]:.0f} MB/s)" for v in VARIANTS))
        print(
            f"   ours / lightning {result['ours_over_lightning']:.3f} "
            f"[quartiles {quartiles_text(result['ours_over_lightning_quartiles'])}], "
            f"ours / ours with the MD5 after the send {result['ours_over_ours_md5_after']:.3f} "
            f"[{quartiles_text(result['ours_over_ours_md5_after_quartiles'])}]"
        )
    write_json(args.name, {"links": results}, out=args.out)
    plot(results, args.out, args.name)


if __name__ == "__main__":
    main()
