"""The proxy's metrics: Prometheus text and the Ray exporter's arithmetic (with stand-in Ray metric classes)."""

from __future__ import annotations

from types import SimpleNamespace

from rl_cluster.proxy.metrics import LatencyHistogram, render_prometheus
from rl_cluster.proxy.ray_metrics import RayMetrics


class FakeMetric:
    def __init__(self, name, description="", tag_keys=None, boundaries=None):
        self.name, self.tag_keys, self.boundaries = name, tag_keys, boundaries
        self.values: dict = {}
        self.observed: list = []

    @staticmethod
    def _key(tags):
        return tuple(sorted((tags or {}).items()))

    def set(self, value, tags=None):
        self.values[self._key(tags)] = value

    def inc(self, value=1.0, tags=None):
        self.values[self._key(tags)] = self.values.get(self._key(tags), 0) + value

    def observe(self, value, tags=None):
        self.observed.append((value, tags))


FAKE_RAY = SimpleNamespace(Gauge=FakeMetric, Counter=FakeMetric, Histogram=FakeMetric)


def stats(requests: int, affinity: int, state: str = "active", retries: int = 0) -> dict:
    return {
        "replicas": {
            "r0": {
                "url": "http://x",
                "state": state,
                "requests": requests,
                "in_flight": 2,
                "adapters_loaded": ["a", "b"],
                "adapters_ever_loaded": ["a", "b"],
            }
        },
        "routing": {"affinity": affinity, "spill": 1, "unmatched": 0},
        "retries": retries,
        "streams_broken": 0,
        "adapters_routable": ["a"],
        "base_models": ["m"],
        "paused": False,
    }


def test_ray_counters_advance_by_differences():
    metrics = RayMetrics(FAKE_RAY)
    metrics.update(stats(requests=5, affinity=3))
    metrics.update(stats(requests=8, affinity=3, retries=1))
    assert metrics.requests.values == {(("replica", "r0"),): 8}
    assert metrics.routes.values[(("reason", "affinity"),)] == 3
    assert metrics.routes.values[(("reason", "spill"),)] == 1
    assert metrics.retries.values == {(): 1}
    assert metrics.in_flight.values == {(("replica", "r0"),): 2}
    assert metrics.adapters_loaded.values == {(("replica", "r0"),): 2}
    assert metrics.adapters_routable.values == {(): 1}
    # The replica was removed and registered again: its count restarts, and the counter keeps rising.
    metrics.update(stats(requests=2, affinity=3, state="unhealthy"))
    assert metrics.requests.values == {(("replica", "r0"),): 10}
    assert metrics.active.values == {(("replica", "r0"),): 0}


def test_broadcast_latencies_reach_ray_and_prometheus():
    histogram = LatencyHistogram()
    metrics = RayMetrics(FAKE_RAY)
    histogram.listeners.append(metrics.observe_broadcast)
    histogram.observe("load", 0.07)
    histogram.observe("pause", 3.0)
    assert metrics.broadcast.observed == [(0.07, {"op": "load"}), (3.0, {"op": "pause"})]
    assert list(metrics.broadcast.boundaries) == list(LatencyHistogram.BUCKETS)
    text = render_prometheus(stats(requests=4, affinity=2, retries=3), histogram)
    assert 'rl_proxy_broadcast_seconds_bucket{op="load",le="0.1"} 1' in text
    assert 'rl_proxy_broadcast_seconds_bucket{op="load",le="0.05"} 0' in text
    assert 'rl_proxy_broadcast_seconds_count{op="pause"} 1' in text
    assert 'rl_proxy_requests_total{replica="r0"} 4' in text
    assert 'rl_proxy_route_total{reason="affinity"} 2' in text
    assert "rl_proxy_retries_total 3" in text
    assert 'rl_proxy_adapter_loaded{replica="r0",adapter="b"} 1' in text


def test_real_ray_metric_classes_accept_our_definitions():
    """Constructing ray.util.metrics objects needs no running Ray; this catches bad names or tag keys."""
    metrics = RayMetrics()
    assert metrics.routes.info["name"] == "rl_proxy_route"
    assert metrics.routes.info["tag_keys"] == ("reason",)
    assert metrics.requests.info["tag_keys"] == ("replica",)
    assert metrics.retries.info["tag_keys"] == ()
    assert metrics.broadcast.info["tag_keys"] == ("op",)
    assert metrics.broadcast.boundaries == list(LatencyHistogram.BUCKETS)


def label_keys(text: str, name: str) -> tuple[str, ...]:
    """The label names of the first sample of `name` on a Prometheus page (a histogram's `le` left out)."""
    sample = next(line for line in text.splitlines() if line.startswith((f"{name}{{", f"{name}_bucket{{")))
    pairs = sample[sample.index("{") + 1 : sample.index("}")].split(",")
    return tuple(key for key, _ in (pair.split("=", 1) for pair in pairs) if key != "le")


def test_ray_and_prometheus_show_the_same_metrics():
    """Every Ray metric is on /metrics under the name a scrape of Ray shows (counters with _total), with
    the same kind, help and labels; the page has only rl_proxy_adapter_loaded besides."""
    metrics = RayMetrics()
    histogram = LatencyHistogram()
    histogram.observe("load", 0.5)
    text = render_prometheus(stats(requests=1, affinity=1), histogram)
    kinds = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE")}
    ray_side = {
        "counter": [metrics.requests, metrics.routes, metrics.retries],
        "gauge": [metrics.in_flight, metrics.active, metrics.adapters_loaded, metrics.adapters_routable],
        "histogram": [metrics.broadcast],
    }
    names = set()
    for kind, group in ray_side.items():
        for info in (metric.info for metric in group):
            name = f"{info['name']}_total" if kind == "counter" else info["name"]
            names.add(name)
            assert kinds.get(name) == kind, name
            assert f"# HELP {name} {info['description']}\n" in text
            if info["tag_keys"]:
                assert label_keys(text, name) == info["tag_keys"], name
    assert set(kinds) - names == {"rl_proxy_adapter_loaded"}
