"""The Prometheus exporter read back through a real Prometheus server, and the Grafana dashboard over its series."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_accel as la
from lightning_accel.monitor import goodput, idle, utilization
from lightning_accel.monitor.exporter import run_label, series_name
from tests.conftest import tiny_trainer_kwargs

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs/grafana/lightning_accel.json"
EXPORTED = {series_name(k) for k in goodput.METRIC_KEYS + utilization.METRIC_KEYS + idle.IDLE_KEYS}


def dashboard_series() -> set[str]:
    exprs = [
        t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel.get("targets", [])
    ]  # rows have none
    exprs += [v["query"] for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["type"] == "query"]
    return {name for expr in exprs for name in re.findall(r"\blightning_accel_\w+", expr)}


def test_every_series_the_dashboard_queries_is_one_the_monitors_export():
    queried = dashboard_series()
    assert len(queried) >= 25
    assert queried <= EXPORTED, f"the dashboard queries series nobody exports: {sorted(queried - EXPORTED)}"
    # and the ledger is on it, bucket by bucket
    assert {series_name(f"goodput/{b}_share") for b in ("data", "compute", "checkpoint", "other")} <= queried


def test_the_dashboard_draws_each_bucket_in_the_pngs_colour_and_rss_on_its_own_axis():
    """goodput.png and the dashboard agree: every panel that draws the ledger's buckets gives each the colour of
    monitor/plot.py's COLORS; the host panel puts RSS (GiB) on a right axis of its own, not flat under CPU %."""
    from lightning_accel.monitor.plot import COLORS

    panels = json.loads(DASHBOARD.read_text())["panels"]
    by_bucket = [p for p in panels if any(t.get("legendFormat") in COLORS for t in p.get("targets", []))]
    assert len(by_bucket) >= 2
    for panel in by_bucket:
        colours = {
            o["matcher"]["options"]: prop["value"]["fixedColor"]
            for o in panel["fieldConfig"]["overrides"]
            for prop in o["properties"]
            if prop["id"] == "color"
        }
        drawn = {t["legendFormat"] for t in panel["targets"] if t.get("legendFormat") in COLORS}
        assert colours == {bucket: COLORS[bucket] for bucket in drawn}, panel["title"]
    (host,) = [p for p in panels if p.get("title") == "Host CPU (%) and process RSS (GiB)"]
    assert host["fieldConfig"]["defaults"]["unit"] == "percent"
    (rss,) = host["fieldConfig"]["overrides"]
    assert rss["matcher"] == {"id": "byRegexp", "options": "RSS.*"}
    assert {p["id"]: p["value"] for p in rss["properties"]} == {"unit": "gbytes", "custom.axisPlacement": "right"}


def test_the_run_label_is_the_runs_id_on_every_rank_unless_one_is_given(monkeypatch):
    """The checkpoint's run id (kept across attempts) first, then LIGHTNING_ACCEL_RUN_ID or torchrun's rendezvous id,
    then rank 0's fresh id, broadcast; an exporter given a run keeps it."""
    sent = []
    strategy = SimpleNamespace(broadcast=lambda obj, src: sent.append(obj) or "from-rank-0")
    with_ckpt = SimpleNamespace(callbacks=[object(), SimpleNamespace(run_id="abc123")], strategy=strategy)
    bare = SimpleNamespace(callbacks=[SimpleNamespace(run_id="")], strategy=strategy)
    monkeypatch.delenv("LIGHTNING_ACCEL_RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's value without --rdzv-id: no id
    assert run_label(with_ckpt) == "abc123" and sent == []
    assert run_label(bare) == "from-rank-0" and len(sent) == 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert run_label(bare) == "job-7"
    monkeypatch.setenv("LIGHTNING_ACCEL_RUN_ID", "mine")
    assert run_label(bare) == "mine"
    exporter, named = la.PrometheusExporter(port=0), la.PrometheusExporter(port=0, run="fixed")
    exporter.follow_run("abc123"), named.follow_run("abc123")
    assert (exporter.run, named.run, exporter.host) == ("abc123", "fixed", socket.gethostname())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="needs Debian's prometheus server; `make test` installs it (apt-get install prometheus)",
)
def test_metrics_read_back_from_a_real_prometheus_equal_the_callbacks(tmp_path):
    exporter = la.PrometheusExporter(port=0)  # owned by the test: it serves the final values after fit
    pricing = la.Pricing(on_demand_per_hour=3.0, spot_per_hour=1.0, market="spot")  # the cost row's series too
    monitor = la.GoodputMonitor(every_n_steps=5, prometheus=exporter, summary=False, plot=False, pricing=pricing)
    util = la.UtilizationMonitor(every_n_seconds=0.0, prometheus=exporter, summary=False)
    idle_monitor = la.IdleMonitor(poll_s=0.05, prometheus=exporter, watch_after_fit=False)
    ckpt = la.PreemptionCheckpoint(dirpath=tmp_path / "ckpt", every_n_steps=5)
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=20, callbacks=[monitor, util, ckpt, idle_monitor])).fit(
        BoringModel()
    )
    assert exporter.bound_port is not None
    web = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: lightning_accel\n    static_configs: [{{targets: ['127.0.0.1:{exporter.bound_port}']}}]\n"
    )
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("w"),
    )
    prom = f"http://127.0.0.1:{web}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if query(prom, "lightning_accel_goodput_total_s"):
                    break
            except OSError:
                pass  # not listening yet
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        for key, value in monitor.results.items():
            (sample,) = query(prom, series_name(key))
            assert sample["metric"]["rank"] == "0" and sample["metric"]["job"] == "lightning_accel"
            assert sample["metric"]["run"] == ckpt.run_id and sample["metric"]["host"] == socket.gethostname()
            assert float(sample["value"][1]) == value, key  # exact: both sides print floats round-trip
        for key, value in util.last.items():
            (sample,) = query(prom, series_name(key))
            assert float(sample["value"][1]) == value, key
        scraped = {s["metric"]["__name__"] for s in query(prom, '{job="lightning_accel"}')}
        # Not in this run: no GPU, one rank, float batches (no tokens).
        absent = {
            "goodput/straggler_ratio",
            "goodput/slowest_rank",
            "goodput/straggler_rank",
            "goodput/presync_step_s",
            "throughput/tokens_per_sec",
            "cost/usd_per_million_tokens",
            *utilization.GPU_KEYS,
        }
        assert dashboard_series() - {series_name(k) for k in absent} <= scraped
    finally:
        server.terminate()
        server.wait(timeout=30)
        idle_monitor.close()
        exporter.close()


def test_the_exporter_serves_the_final_values_for_linger_s_after_the_fit_then_stops():
    """A short run ends between two scrapes: with linger_s the endpoint answers with the final values a while
    longer (a non-daemon timer, so a script's process waits for it), then closes; a new fit stops it first."""

    def scrape(port: int) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()

    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="linger_s must be a number of seconds >= 0"):
            la.PrometheusExporter(port=0, linger_s=bad)
    exporter = la.PrometheusExporter(port=0, linger_s=1.0)
    exporter.publish({"goodput/compute_share": 0.75})
    port = exporter.bound_port
    exporter.close()  # the fit is over
    assert "lightning_accel_goodput_compute_share" in scrape(port)  # still served
    time.sleep(1.5)
    with pytest.raises(OSError):
        scrape(port)
    at_once = la.PrometheusExporter(port=0)
    at_once.publish({"x": 1.0})
    port = at_once.bound_port
    at_once.close()
    with pytest.raises(OSError):
        scrape(port)
    # a second fit in the same process while the first one's endpoint lingers: it makes way at once
    again = la.PrometheusExporter(port=0, linger_s=30.0)
    again.publish({"x": 1.0})
    again.close()
    again.publish({"x": 2.0})
    assert 'x{host="' in scrape(again.bound_port).replace("lightning_accel_", "") and again._lingering is None
    again.linger_s = 0.0
    again.close()


@pytest.mark.multiprocess
def test_an_exporter_nobody_closes_lingers_at_the_processs_exit(tmp_path):
    """What a recipe makes (recipes/mlp_cpu_prometheus.yaml): nobody calls close(), so the process's exit waits
    linger_s with the endpoint up, then ends."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "from lightning_accel import PrometheusExporter\n"
        "exporter = PrometheusExporter(port=0, linger_s=3.0)\n"
        "exporter.publish({'goodput/compute_share': 0.5})\n"
        "print(exporter.bound_port, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    assert "lightning_accel_goodput_compute_share" in body and proc.poll() is None  # the script is done, still serving
    assert proc.wait(timeout=30) == 0
