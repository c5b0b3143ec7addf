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
    assert metrics.broadcast is not None
