"""A real Prometheus for tests: Debian's, unpacked by `make tools` into .cache/tools (not installed: no
service, nothing system-wide). It scrapes a Ray cluster through the service-discovery file Ray writes
(as Ray's own generated prometheus.yml does), on loopback only, and answers queries through its HTTP
API as Grafana asks them."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / ".cache" / "tools" / "prometheus" / "usr" / "bin" / "prometheus"
DASHBOARD = REPO / "ray_configs" / "grafana" / "rl_cluster_dashboard.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def panel_queries(run: str) -> dict[str, str]:
    """Every query of the Grafana dashboard, as Grafana sends it for `run`: query -> its panel's title."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    found = {}
    for panel in [q for p in panels for q in [p, *p.get("panels", [])]]:
        for target in panel.get("targets", []):
            found[target["expr"].replace("$run", run)] = panel["title"]  # run names need no escaping
    return found


@contextlib.contextmanager
def prometheus(discovery_file: Path, work: Path, scrape_s: float = 1.0) -> Iterator[str]:
    """Prometheus scraping what `discovery_file` (Ray's prom_metrics_service_discovery.json) lists, every
    `scrape_s`, each target on its port at 127.0.0.1; yields its base URL, and stops it (by pid)."""
    assert PROMETHEUS.exists(), f"{PROMETHEUS} is missing: `make tools` unpacks Debian's prometheus there"
    work.mkdir(parents=True, exist_ok=True)
    config = {  # JSON is YAML
        "global": {"scrape_interval": f"{scrape_s:g}s", "evaluation_interval": f"{scrape_s:g}s"},
        "scrape_configs": [{
            "job_name": "ray",
            "file_sd_configs": [{"files": [str(discovery_file)], "refresh_interval": "1s"}],
            # Ray lists each node's address; this machine's own nodes are scraped on loopback.
            "relabel_configs": [{"source_labels": ["__address__"], "regex": r"[^:]+:(\d+)",
                                 "target_label": "__address__", "replacement": "127.0.0.1:$1"}],
        }],
    }  # fmt: skip
    (work / "prometheus.yml").write_text(json.dumps(config))
    url = f"http://127.0.0.1:{_free_port()}"
    with open(work / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address={url.removeprefix('http://')}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{url}/-/ready", timeout=5).status == 200:
                    break
            assert time.monotonic() < deadline, (work / "prometheus.log").read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _api(url: str, path: str, params: dict) -> list[dict]:
    """The result of one Prometheus HTTP API query (`path` under /api/v1/), which must have succeeded."""
    answer = json.loads(
        urllib.request.urlopen(f"{url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30).read()
    )
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def query(url: str, expr: str) -> list[dict]:
    """The instant vector `expr` evaluates to now (Prometheus's /api/v1/query), as Grafana asks it."""
    return _api(url, "query", {"query": expr})


def query_range(url: str, expr: str, start: float, end: float, step_s: float = 2.0) -> list[dict]:
    """The range vectors `expr` evaluates to from `start` to `end` (Unix seconds), as Grafana asks for a
    panel's curve (Prometheus's /api/v1/query_range)."""
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}s"}
    return _api(url, "query_range", params)


def plot_range(series: list[dict], title: str, path: Path) -> None:
    """A PNG of `series` (query_range's answer) against seconds since its first sample, one line each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(float(s["values"][0][0]) for s in series)
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=100)
    for s in series:
        label = ", ".join(f"{k}={v}" for k, v in sorted(s["metric"].items())) or None
        ax.plot([float(t) - t0 for t, _ in s["values"]], [float(v) for _, v in s["values"]], label=label)
    ax.set(title=title, xlabel="seconds since the first sample")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
