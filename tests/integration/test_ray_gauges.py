"""Our gauges hold their value on a real Ray node's metrics export (rl_cluster.telemetry.RayMetricSet), where a
plain ray.util.metrics.Gauge set once is gone from it two export intervals later: a served-vs-trained check
or an eval score, set once per many steps, was missing from Prometheus most of the run."""

from __future__ import annotations

import time
import urllib.request

import pytest
import ray
from ray.util import metrics as ray_metrics

from rl_cluster.core.telemetry import MetricDef
from rl_cluster.telemetry import RayMetricSet

pytestmark = pytest.mark.vllm  # the slow lane: it starts a Ray cluster

HELD = "rl_test_held_gauge"
PLAIN = "rl_test_plain_gauge"


@ray.remote(num_cpus=0)
class Emitter:
    def __init__(self):
        self.ours = RayMetricSet((MetricDef(HELD, "gauge", "Set once, held."),), "telemetry-test")
        self.plain = ray_metrics.Gauge(PLAIN, "Set once.", tag_keys=("run",))

    def set_once(self) -> None:
        self.ours.set(HELD, 3.0)
        self.plain.set(5.0, tags={"run": "telemetry-test"})


@pytest.fixture(scope="module")
def export_url():
    # Ray's agent keeps a gauge two export intervals: 2 s exports make that 4 s (10 s exports, 20 s).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_metrics_report_interval_ms", "2000")
        ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        yield f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"
    finally:
        ray.shutdown()


def series(url: str) -> set[str]:
    """The names of our test gauges on the node's export page now."""
    page = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        name for name in (HELD, PLAIN) if any(line.startswith(f"ray_{name}{{") for line in page.splitlines())
    }


def test_a_gauge_set_once_stays_exported_where_a_plain_ray_gauge_is_dropped(export_url):
    emitter = Emitter.remote()
    ray.get(emitter.set_once.remote())
    deadline = time.monotonic() + 60
    while PLAIN not in (seen := series(export_url)):  # both were exported: the page shows what was set
        assert time.monotonic() < deadline, f"{PLAIN} never reached the node's export: {seen}"
        time.sleep(0.3)
    while PLAIN in (seen := series(export_url)):
        assert time.monotonic() < deadline, f"{PLAIN} still exported a minute after it was set once"
        time.sleep(0.5)
    # The plain gauge aged out; ours was recorded again each second since, on this page or the next ones.
    pages = [seen] + [series(export_url) for _ in range(3) if not time.sleep(1)]
    assert any(HELD in p for p in pages), pages
