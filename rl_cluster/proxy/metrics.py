"""The proxy's metrics: defined once here, exposed through prometheus_client (GET /metrics) and mirrored
into Ray metrics (rl_cluster.proxy.ray_metrics) from the same definitions.

Each gauge and counter is one `Metric` in METRICS: name, kind, help, labels, and how its samples come
out of a `ProxyServer.stats()` snapshot. The /metrics page is a prometheus_client collector that turns
those samples into metric families at scrape time (prometheus_client writes the text: escaping of
label values and help included); the Ray exporter walks the same list. Broadcast latencies are the
one metric observed as events, not read from a snapshot: a prometheus_client Histogram, whose
observations Ray's histogram receives too. Counters are named without `_total`: prometheus_client adds
it, as Ray's exporter does for its counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.core import Metric as Family
from prometheus_client.registry import Collector

ROUTE_REASONS = ("affinity", "spill", "unmatched")
# How a replica failed a request the proxy then sent to another (ReplicaFailed.cause).
RETRY_CAUSES = ("connection", "timeout", "error_answer", "protocol")
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes: the classic text format
Samples = dict[tuple[str, ...], float]  # label values (in the metric's label order) -> value


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Literal["gauge", "counter"]
    help: str
    labels: tuple[str, ...]
    samples: Callable[[dict], Samples]
    """The metric's samples in a `ProxyServer.stats()` snapshot."""
    ray: bool = True
    """Mirrored into Ray. False for per-adapter series: Ray keeps every label set it was ever given, so
    a run's hundreds of retired versions would stay on the dashboard."""


def _per_replica(value: Callable[[dict], float]) -> Callable[[dict], Samples]:
    return lambda stats: {(rid,): value(replica) for rid, replica in stats["replicas"].items()}


METRICS = (
    Metric("rl_proxy_in_flight", "gauge", "Requests in flight per replica.", ("replica",),
           _per_replica(lambda r: r["in_flight"])),
    Metric("rl_proxy_capacity", "gauge", "Concurrent sequences a replica runs (vLLM max_num_seqs); "
           "routing compares in-flight counts relative to it.", ("replica",),
           _per_replica(lambda r: r.get("capacity") or 0)),
    Metric("rl_proxy_requests", "counter", "Requests routed per replica.", ("replica",),
           _per_replica(lambda r: r["requests"])),
    Metric("rl_proxy_replica_active", "gauge", "1 when the replica takes traffic (state active).", ("replica",),
           _per_replica(lambda r: int(r["state"] == "active"))),
    Metric("rl_proxy_route", "counter", "Routing decisions by reason (affinity, spill, unmatched).",
           ("reason",), lambda s: {(k,): s["routing"][k] for k in ROUTE_REASONS}),
    Metric("rl_proxy_retries", "counter", "Generations retried on another replica, by the replica that "
           f"failed them and how ({', '.join(RETRY_CAUSES)}).", ("replica", "cause"),
           lambda s: {(rid, cause): n for rid, causes in s["retried"].items() for cause, n in causes.items()}),
    Metric("rl_proxy_adapters_loaded", "gauge", "Adapter versions loaded per replica.", ("replica",),
           _per_replica(lambda r: len(r["adapters_loaded"]))),
    Metric("rl_proxy_adapter_loaded", "gauge", "1 for each adapter version loaded on a replica.",
           ("replica", "adapter"),
           lambda s: {(rid, a): 1 for rid, r in s["replicas"].items() for a in r["adapters_loaded"]},
           ray=False),
    Metric("rl_proxy_adapters_routable", "gauge", "Adapter versions routable.", (),
           lambda s: {(): len(s["adapters_routable"])}),
)  # fmt: skip


@dataclass(frozen=True)
class HistogramMetric:
    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...]


BROADCAST_SECONDS = HistogramMetric(
    "rl_proxy_broadcast_seconds",
    "Seconds a broadcast (load, unload, pause, resume) to every replica took.",
    ("op",),
    (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)


class LatencyHistogram:
    """Broadcast latencies by operation, in a prometheus_client Histogram on `registry`. Listeners see
    every observation too (the Ray exporter forwards them to a ray.util.metrics.Histogram)."""

    BUCKETS = BROADCAST_SECONDS.buckets

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        m = BROADCAST_SECONDS
        self._histogram = Histogram(m.name, m.help, m.labels, registry=self.registry, buckets=m.buckets)
        self.listeners: list[Callable[[str, float], None]] = []

    def observe(self, op: str, seconds: float) -> None:
        self._histogram.labels(op).observe(seconds)
        for listener in self.listeners:
            listener(op, seconds)

    def count(self, op: str) -> int:
        return int(self.registry.get_sample_value(f"{BROADCAST_SECONDS.name}_count", {"op": op}) or 0)


class _StatsCollector(Collector):
    """METRICS as prometheus_client families, read from a fresh stats snapshot at each scrape."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self) -> Iterator[Family]:
        stats = self._stats()
        for metric in METRICS:
            family_type = GaugeMetricFamily if metric.kind == "gauge" else CounterMetricFamily
            family = family_type(metric.name, metric.help, labels=metric.labels)
            for values, value in metric.samples(stats).items():
                family.add_metric(values, value)
            yield family


class ProxyMetrics:
    """One proxy's metrics registry: the stats-backed gauges and counters, and the broadcast histogram.
    Its own registry (not prometheus_client's global one), so several proxies in one process (tests)
    do not collide."""

    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.broadcast_latency = LatencyHistogram(self.registry)
        self.registry.register(_StatsCollector(stats))

    def render(self) -> bytes:
        """The /metrics page (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)
