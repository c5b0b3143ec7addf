"""The proxy's metrics as Ray metrics (ray.util.metrics), so the Ray dashboard and its Prometheus show them.

Only the ProxyActor uses this; ProxyServer knows nothing of Ray. Gauges and counters are refreshed from
`ProxyServer.stats()` snapshots (counters advance by the difference since the last snapshot, since Ray
counters only increment); broadcast latencies are forwarded one by one as they are observed.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from rl_cluster.proxy.metrics import ROUTE_REASONS, LatencyHistogram

EXPORT_INTERVAL_S = 5.0


class RayMetrics:
    """Mirrors proxy stats into Ray metrics. `metrics` is ray.util.metrics unless a test passes a stand-in."""

    def __init__(self, metrics: ModuleType | None = None):
        m = metrics or importlib.import_module("ray.util.metrics")
        replica = ("replica",)
        self.in_flight = m.Gauge("rl_proxy_in_flight", "Requests in flight per replica.", tag_keys=replica)
        self.requests = m.Counter("rl_proxy_requests", "Requests routed per replica.", tag_keys=replica)
        self.active = m.Gauge(
            "rl_proxy_replica_active", "1 when the replica takes traffic.", tag_keys=replica
        )
        self.adapters_loaded = m.Gauge(
            "rl_proxy_adapters_loaded", "Adapter versions loaded per replica.", tag_keys=replica
        )
        self.routes = m.Counter(
            "rl_proxy_routes",
            "Routing decisions by reason (affinity, spill, unmatched).",
            tag_keys=("reason",),
        )
        self.retries = m.Counter("rl_proxy_retries", "Generations retried on another replica.")
        self.adapters_routable = m.Gauge("rl_proxy_adapters_routable", "Adapter versions routable.")
        self.broadcast = m.Histogram(
            "rl_proxy_broadcast_seconds",
            "Seconds a broadcast (load, unload, pause, resume) to every replica took.",
            boundaries=list(LatencyHistogram.BUCKETS),
            tag_keys=("op",),
        )
        self._seen: dict[tuple[str, str], float] = {}  # counter key -> value at the last update

    def observe_broadcast(self, op: str, seconds: float) -> None:
        self.broadcast.observe(seconds, tags={"op": op})

    def update(self, stats: dict) -> None:
        """Bring every gauge and counter to the values of one `ProxyServer.stats()` snapshot."""
        for rid, replica in stats["replicas"].items():
            tags = {"replica": rid}
            self.in_flight.set(replica["in_flight"], tags=tags)
            self.active.set(int(replica["state"] == "active"), tags=tags)
            self.adapters_loaded.set(len(replica["adapters_loaded"]), tags=tags)
            self._advance(self.requests, ("requests", rid), replica["requests"], tags)
        for reason in ROUTE_REASONS:
            self._advance(self.routes, ("routes", reason), stats["routing"][reason], {"reason": reason})
        self._advance(self.retries, ("retries", ""), stats["retries"], None)
        self.adapters_routable.set(len(stats["adapters_routable"]))

    def _advance(self, counter, key: tuple[str, str], value: float, tags: dict | None) -> None:
        # A count below the last one means the replica was removed and registered again: it counts anew.
        last = self._seen.get(key, 0)
        delta = value - last if value >= last else value
        if delta > 0:
            counter.inc(delta, tags=tags)
        self._seen[key] = value
