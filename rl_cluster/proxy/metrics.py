"""The proxy's own metrics in Prometheus text form (GET /metrics), and the broadcast-latency histogram.

Rendering works from `ProxyServer.stats()` so the text and the Ray exporter (rl_cluster.proxy.ray_metrics)
read the same numbers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

ROUTE_REASONS = ("affinity", "spill", "unmatched")


class LatencyHistogram:
    """A Prometheus histogram of control-broadcast latencies, labelled by operation. Listeners see every
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

    def render(self, name: str) -> list[str]:
        lines = [f"# HELP {name} Seconds a broadcast to every replica took.", f"# TYPE {name} histogram"]
        for op, counts in sorted(self._counts.items()):
            for bound, count in zip((*self.BUCKETS, "+Inf"), counts, strict=True):
                lines.append(f'{name}_bucket{{op="{op}",le="{bound}"}} {count}')
            lines.append(f'{name}_sum{{op="{op}"}} {self._sums[op]}')
            lines.append(f'{name}_count{{op="{op}"}} {counts[-1]}')
        return lines


def metric_lines(name: str, kind: str, help_text: str, samples: dict[str, float]) -> list[str]:
    """Prometheus text lines of one metric; `samples` maps a label string ('' for none) to a value."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    return lines + [
        f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in samples.items()
    ]


def render_prometheus(stats: dict, histogram: LatencyHistogram) -> str:
    """The whole /metrics page from a `ProxyServer.stats()` snapshot."""
    replicas = stats["replicas"]
    lines = [
        *metric_lines("rl_proxy_in_flight", "gauge", "Requests in flight per replica.",
                      {f'replica="{r}"': s["in_flight"] for r, s in replicas.items()}),
        *metric_lines("rl_proxy_requests_total", "counter", "Requests routed per replica.",
                      {f'replica="{r}"': s["requests"] for r, s in replicas.items()}),
        *metric_lines("rl_proxy_replica_active", "gauge", "1 when the replica takes traffic (state active).",
                      {f'replica="{r}"': int(s["state"] == "active") for r, s in replicas.items()}),
        *metric_lines("rl_proxy_route_total", "counter", "Routing decisions by reason (affinity, spill, unmatched).",
                      {f'reason="{k}"': stats["routing"][k] for k in ROUTE_REASONS}),
        *metric_lines("rl_proxy_retries_total", "counter", "Generations retried on another replica.",
                      {"": stats["retries"]}),
        *metric_lines("rl_proxy_adapters_loaded", "gauge", "Adapter versions loaded per replica.",
                      {f'replica="{r}"': len(s["adapters_loaded"]) for r, s in replicas.items()}),
        *metric_lines("rl_proxy_adapter_loaded", "gauge", "1 for each adapter version loaded on a replica.",
                      {f'replica="{r}",adapter="{a}"': 1 for r, s in replicas.items() for a in s["adapters_loaded"]}),
        *metric_lines("rl_proxy_adapters_routable", "gauge", "Adapter versions routable.",
                      {"": len(stats["adapters_routable"])}),
        *histogram.render("rl_proxy_broadcast_seconds"),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"
