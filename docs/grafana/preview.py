"""Render what the Grafana dashboard shows, from a real run scraped by a real Prometheus (no Grafana needed).

Trains the tiny GPT on the CPU for about half a minute with both monitors exporting, lets Debian's
``prometheus`` scrape them every second, then runs every query of ``lightning_accel.json`` through
Prometheus's HTTP API (``query_range``) and draws the panels where the dashboard puts them.

    python docs/grafana/preview.py [--steps 400] [--out docs/images/dashboard_preview.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import lightning as L

import lightning_accel as la
from lightning_accel.demos import SyntheticTokenDataModule, TinyGPT

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def train(exporter: la.PrometheusExporter, steps: int, folder: Path) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=4,
        val_check_interval=100,
        callbacks=[
            la.GoodputMonitor(every_n_steps=5, prometheus=exporter, summary=False, plot=False),
            la.UtilizationMonitor(every_n_seconds=1.0, prometheus=exporter, summary=False),
            la.PreemptionCheckpoint(dirpath=folder / "ckpt", every_n_steps=20, keep_last=1),
        ],
    )
    trainer.fit(TinyGPT(d_model=64, n_layers=2), datamodule=SyntheticTokenDataModule(num_samples=16 * steps))


def render(prom: str, start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads((HERE / "lightning_accel.json").read_text())
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    fig = plt.figure(figsize=(16, rows * 0.42))
    fig.suptitle(f"{dashboard['title']}: rendered from Prometheus, one CPU rank", fontsize=12, y=0.995)
    top = 0.985  # below the title
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        left, width = g["x"] / 24 + 0.035, g["w"] / 24 - 0.05
        height = g["h"] / rows * top - 0.035
        bottom = top - (g["y"] + g["h"]) / rows * top + 0.02
        ax = fig.add_axes([left, bottom, width, height])
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        stacked = panel["fieldConfig"]["defaults"].get("custom", {}).get("stacking", {}).get("mode") == "percent"
        lines: list[tuple[str, list[float], list[float]]] = []
        for target in panel["targets"]:
            expr = target["expr"].replace('"$rank"', '".*"')
            query = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": 1})
            for series in get(f"{prom}/api/v1/query_range?{query}")["data"]["result"]:
                t = [float(ts) - start for ts, _ in series["values"]]
                v = [float(value) for _, value in series["values"]]
                label = target.get("legendFormat", "").replace("{{rank}}", series["metric"].get("rank", ""))
                lines.append((label, t, v))
        if not lines:
            ax.set_xticks([])
            ax.set_yticks([])
            ax.text(
                0.5,
                0.5,
                "no data on this run"
                if panel["type"] == "stat"
                else "no data on this run (needs a GPU or several ranks)",
                ha="center",
                va="center",
                fontsize=8,
                color="gray",
                transform=ax.transAxes,
            )
        elif panel["type"] == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            ax.text(0.5, 0.4, f"{lines[0][2][-1]:.3g}", ha="center", va="center", fontsize=16, transform=ax.transAxes)
        elif stacked and len({len(t) for _, t, _ in lines}) == 1:
            ax.stackplot(lines[0][1], *[v for _, _, v in lines], labels=[label for label, _, _ in lines])
            ax.set_ylim(0, 1)
            ax.legend(fontsize=7, loc="lower left", ncol=len(lines), framealpha=0.85)
        else:
            for label, t, v in lines:
                ax.plot(t, v, label=label, linewidth=1.2)
            ax.legend(fontsize=6, loc="upper left", ncol=4, frameon=False)
        if lines and panel["type"] != "stat":
            ax.set_xlabel("seconds into the run", fontsize=7)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", type=Path, default=HERE.parent / "images" / "dashboard_preview.png")
    args = p.parse_args()
    if shutil.which("prometheus") is None:
        raise SystemExit("needs Debian's prometheus server: apt-get install prometheus (make test installs it)")
    folder = Path(tempfile.mkdtemp(prefix="dashboard_"))
    exporter = la.PrometheusExporter(port=0)
    exporter.start()
    web = free_port()
    (folder / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: lightning_accel\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{exporter.bound_port}']}}]\n"
    )
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    prom = f"http://127.0.0.1:{web}"
    try:
        start = time.time()
        train(exporter, args.steps, folder)
        time.sleep(3)  # the last values scraped
        render(prom, start, time.time(), args.out)
        print(f"wrote {args.out}")
    finally:
        server.terminate()
        server.wait(timeout=30)
        exporter.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
