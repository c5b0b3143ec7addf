"""The proxy's metrics: defined once here, shown as Prometheus text (GET /metrics) and as Ray metrics.

Each metric is one `Metric` below: name, kind, help and labels. The /metrics page (render_prometheus)
and the Ray exporter (rl_cluster.proxy.ray_metrics) both build from these, and both read the numbers
from `ProxyServer.stats()`, so the two views cannot drift apart. Counters are named without `_total`:
the Prometheus text adds it, as Ray's exporter does for its counters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ROUTE_REASONS = ("affinity", "spill", "unmatched")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Literal["gauge", "counter", "histogram"]
    help: str
    labels: tuple[str, ...] = ()

    @property
    def exported_name(self) -> str:
        """The name a Prometheus scrape shows (counters carry `_total`)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


IN_FLIGHT = Metric("rl_proxy_in_flight", "gauge", "Requests in flight per replica.", ("replica",))
REQUESTS = Metric("rl_proxy_requests", "counter", "Requests routed per replica.", ("replica",))
REPLICA_ACTIVE = Metric(
    "rl_proxy_replica_active", "gauge", "1 when the replica takes traffic (state active).", ("replica",)
)
ROUTES = Metric(
    "rl_proxy_route", "counter", "Routing decisions by reason (affinity, spill, unmatched).", ("reason",)
)
RETRIES = Metric("rl_proxy_retries", "counter", "Generations retried on another replica.")
ADAPTERS_LOADED = Metric(
    "rl_proxy_adapters_loaded", "gauge", "Adapter versions loaded per replica.", ("replica",)
)
# Prometheus text only: the Ray exporter does not mirror it.
ADAPTER_LOADED = Metric(
    "rl_proxy_adapter_loaded",
    "gauge",
    "1 for each adapter version loaded on a replica.",
    ("replica", "adapter"),
)
ADAPTERS_ROUTABLE = Metric("rl_proxy_adapters_routable", "gauge", "Adapter versions routable.")
BROADCAST_SECONDS = Metric(
    "rl_proxy_broadcast_seconds",
    "histogram",
    "Seconds a broadcast (load, unload, pause, resume) to every replica took.",
    ("op",),
)


class LatencyHistogram:
    """A Prometheus histogram of admin-broadcast latencies, labelled by operation. Listeners see every
    observation too (the Ray exporter forwards them to a ray.util.metrics.Histogram)."""

    BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}
        self._sums: Counter[str] = Counter()
        self.listeners: list[Callable[[str, float], None]] = []

    def observe(self, op: str, seconds: float) -> None:
        counts = self._counts.setdefault(op, [0] * (len(self.BUCKETS) + 1))
        for i, bound in enumerate(self.BUCKETS):
            if seconds <= bound:
                counts[i] += 1
        counts[-1] += 1  # +Inf
        self._sums[op] += seconds
        for listener in self.listeners:
            listener(op, seconds)

    def count(self, op: str) -> int:
        return self._counts.get(op, [0])[-1]

    def render(self, metric: Metric) -> list[str]:
        name = metric.name
        lines = [f"# HELP {name} {metric.help}", f"# TYPE {name} histogram"]
        for op, counts in sorted(self._counts.items()):
            for bound, count in zip((*self.BUCKETS, "+Inf"), counts, strict=True):
                lines.append(f'{name}_bucket{{op="{op}",le="{bound}"}} {count}')
            lines.append(f'{name}_sum{{op="{op}"}} {self._sums[op]}')
            lines.append(f'{name}_count{{op="{op}"}} {counts[-1]}')
        return lines


def metric_lines(metric: Metric, samples: dict[tuple[str, ...], float]) -> list[str]:
    """Prometheus text lines of one metric; `samples` maps label values (in `metric.labels` order)
    to a value."""
    name = metric.exported_name
    lines = [f"# HELP {name} {metric.help}", f"# TYPE {name} {metric.kind}"]
    for values, value in samples.items():
        labels = ",".join(f'{key}="{v}"' for key, v in zip(metric.labels, values, strict=True))
        lines.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")
    return lines


def render_prometheus(stats: dict, histogram: LatencyHistogram) -> str:
    """The whole /metrics page from a `ProxyServer.stats()` snapshot."""
    replicas = stats["replicas"]
    lines = [
        *metric_lines(IN_FLIGHT, {(r,): s["in_flight"] for r, s in replicas.items()}),
        *metric_lines(REQUESTS, {(r,): s["requests"] for r, s in replicas.items()}),
        *metric_lines(REPLICA_ACTIVE, {(r,): int(s["state"] == "active") for r, s in replicas.items()}),
        *metric_lines(ROUTES, {(k,): stats["routing"][k] for k in ROUTE_REASONS}),
        *metric_lines(RETRIES, {(): stats["retries"]}),
        *metric_lines(ADAPTERS_LOADED, {(r,): len(s["adapters_loaded"]) for r, s in replicas.items()}),
        *metric_lines(ADAPTER_LOADED, {(r, a): 1 for r, s in replicas.items() for a in s["adapters_loaded"]}),
        *metric_lines(ADAPTERS_ROUTABLE, {(): len(stats["adapters_routable"])}),
        *histogram.render(BROADCAST_SECONDS),
    ]
    return "\n".join(lines) + "\n"
