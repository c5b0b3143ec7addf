"""The proxy's metrics: the /metrics page read back with prometheus_client's parser, and the Ray exporter
built from the same definitions (with stand-in Ray metric classes, and with the real ones)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from rl_cluster.proxy.metrics import BROADCAST_SECONDS, METRICS, RETRY_CAUSES, LatencyHistogram, ProxyMetrics
from rl_cluster.proxy.ray_metrics import RayMetrics


class FakeMetric:
    def __init__(self, name, description="", tag_keys=None, boundaries=None):
        self.name, self.description, self.tag_keys, self.boundaries = name, description, tag_keys, boundaries
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


def stats(requests: int, affinity: int, state: str = "active", retries: int = 0, replica: str = "r0") -> dict:
    return {
        "replicas": {
            replica: {
                "url": "http://x",
                "state": state,
                "requests": requests,
                "in_flight": 2,
                "capacity": 256,
                "adapters_loaded": ["a", "b"],
                "adapters_ever_loaded": ["a", "b"],
            }
        },
        "routing": {"affinity": affinity, "spill": 1, "unmatched": 0},
        "retries": retries,
        "retried": {replica: {"connection": retries}} if retries else {},
        "streams_broken": 0,
        "adapters_routable": ["a"],
        "base_models": ["m"],
        "paused": False,
    }


def scrape(metrics: ProxyMetrics) -> dict[tuple[str, tuple], float]:
    """The page as prometheus_client's parser reads it: (sample name, sorted labels) -> value."""
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_page_shows_the_stats_snapshot():
    snapshot = stats(requests=4, affinity=2, retries=3)
    metrics = ProxyMetrics(lambda: snapshot)
    page = scrape(metrics)
    assert page[("rl_proxy_requests_total", (("replica", "r0"),))] == 4
    assert page[("rl_proxy_route_total", (("reason", "affinity"),))] == 2
    assert page[("rl_proxy_retries_total", (("cause", "connection"), ("replica", "r0")))] == 3
    assert page[("rl_proxy_in_flight", (("replica", "r0"),))] == 2
    assert page[("rl_proxy_capacity", (("replica", "r0"),))] == 256
    assert page[("rl_proxy_adapter_loaded", (("adapter", "b"), ("replica", "r0")))] == 1
    # Read at scrape time: a later snapshot shows on the next scrape.
    snapshot["replicas"]["r0"]["requests"] = 9
    assert scrape(metrics)[("rl_proxy_requests_total", (("replica", "r0"),))] == 9


def test_label_values_are_escaped():
    """A replica id or adapter name with quotes, backslashes and newlines must not break the page."""
    odd = 'r"0\\n\nx'
    metrics = ProxyMetrics(lambda: stats(requests=1, affinity=1, replica=odd))
    page = scrape(metrics)
    assert page[("rl_proxy_requests_total", (("replica", odd),))] == 1
    assert '\\"' in metrics.render().decode()  # written escaped, read back as it was


def test_broadcast_latencies_reach_ray_and_prometheus():
    metrics = ProxyMetrics(lambda: stats(requests=0, affinity=0))
    ray = RayMetrics(FAKE_RAY)
    metrics.broadcast_latency.listeners.append(ray.observe_broadcast)
    metrics.broadcast_latency.observe("load", 0.07)
    metrics.broadcast_latency.observe("pause", 3.0)
    assert ray.broadcast.observed == [(0.07, {"op": "load"}), (3.0, {"op": "pause"})]
    assert list(ray.broadcast.boundaries) == list(LatencyHistogram.BUCKETS)
    page = scrape(metrics)
    assert page[("rl_proxy_broadcast_seconds_bucket", (("le", "0.1"), ("op", "load")))] == 1
    assert page[("rl_proxy_broadcast_seconds_bucket", (("le", "0.05"), ("op", "load")))] == 0
    assert page[("rl_proxy_broadcast_seconds_count", (("op", "pause"),))] == 1
    assert metrics.broadcast_latency.count("pause") == 1 and metrics.broadcast_latency.count("resume") == 0


def test_ray_counters_advance_by_differences():
    metrics = RayMetrics(FAKE_RAY)
    requests, routes = metrics.by_name["rl_proxy_requests"], metrics.by_name["rl_proxy_route"]
    metrics.update(stats(requests=5, affinity=3))
    metrics.update(stats(requests=8, affinity=3, retries=1))
    assert requests.values == {(("replica", "r0"),): 8}
    assert routes.values[(("reason", "affinity"),)] == 3
    assert routes.values[(("reason", "spill"),)] == 1
    assert metrics.by_name["rl_proxy_retries"].values == {(("cause", "connection"), ("replica", "r0")): 1}
    assert metrics.by_name["rl_proxy_in_flight"].values == {(("replica", "r0"),): 2}
    assert metrics.by_name["rl_proxy_adapters_routable"].values == {(): 1}
    # The replica was removed and registered again: its count restarts, and the counter keeps rising.
    metrics.update(stats(requests=2, affinity=3, state="unhealthy"))
    assert requests.values == {(("replica", "r0"),): 10}
    assert metrics.by_name["rl_proxy_replica_active"].values == {(("replica", "r0"),): 0}


def test_ray_and_prometheus_show_the_same_metrics():
    """Both views come from METRICS: every definition is on /metrics with its kind, help and labels, and
    every one marked `ray` is a Ray metric of the same name, help and tag keys, set to the same values."""
    snapshot = stats(requests=3, affinity=1, retries=2)
    metrics = ProxyMetrics(lambda: snapshot)
    metrics.broadcast_latency.observe("load", 0.5)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    ray = RayMetrics(FAKE_RAY)
    ray.update(snapshot)
    for definition in METRICS:
        family = families[definition.name]  # the parser names a counter's family without `_total`
        assert (family.type, family.documentation) == (definition.kind, definition.help)
        page_values = {}
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            assert set(sample.labels) == set(definition.labels), definition.name
            page_values[tuple(sorted(sample.labels.items()))] = sample.value
        if not definition.ray:
            assert definition.name not in ray.by_name
            continue
        mirrored = ray.by_name[definition.name]
        assert (mirrored.description, tuple(mirrored.tag_keys)) == (definition.help, definition.labels)
        if definition.kind == "counter":  # a Ray counter's series starts at its first increment
            page_values = {k: v for k, v in page_values.items() if v}
        assert mirrored.values == page_values, definition.name
    assert families[BROADCAST_SECONDS.name].type == "histogram"
    assert ray.broadcast.name == BROADCAST_SECONDS.name


def test_real_ray_metric_classes_accept_our_definitions():
    """Constructing ray.util.metrics objects needs no running Ray; this catches bad names or tag keys."""
    metrics = RayMetrics()
    assert metrics.by_name["rl_proxy_route"].info["name"] == "rl_proxy_route"
    assert metrics.by_name["rl_proxy_route"].info["tag_keys"] == ("reason",)
    assert metrics.by_name["rl_proxy_retries"].info["tag_keys"] == ("replica", "cause")
    assert metrics.broadcast.info["tag_keys"] == ("op",)
    assert metrics.broadcast.boundaries == list(LatencyHistogram.BUCKETS)
    assert {d.name for d in METRICS if d.ray} == set(metrics.by_name)


def test_every_way_a_replica_fails_a_request_is_a_known_retry_cause():
    """The label values of rl_proxy_retries come from ReplicaFailed.cause: one per way, and no other."""
    from aiohttp import web

    from rl_cluster.proxy.forward import ReplicaFailed

    failures = [
        ReplicaFailed("r0", "reset"),
        ReplicaFailed("r0", "no data", timed_out=True),
        ReplicaFailed("r0", "HTTP 503", web.Response(status=503)),
        ReplicaFailed("r0", "malformed JSON", misbehaved=True),
    ]
    assert [f.cause for f in failures] == list(RETRY_CAUSES)
