"""The proxy's metrics as Ray metrics (ray.util.metrics), so the Ray dashboard and its Prometheus show them.

Only the ProxyActor uses this; ProxyServer knows nothing of Ray. The metrics are the ones defined in
rl_cluster.proxy.metrics. Gauges and counters are refreshed from `ProxyServer.stats()` snapshots
(counters advance by the difference since the last snapshot, since Ray counters only increment);
broadcast latencies are forwarded one by one as they are observed.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from rl_cluster.proxy.metrics import (
    ADAPTERS_LOADED,
    ADAPTERS_ROUTABLE,
    BROADCAST_SECONDS,
    IN_FLIGHT,
    REPLICA_ACTIVE,
    REQUESTS,
    RETRIES,
    ROUTE_REASONS,
    ROUTES,
    LatencyHistogram,
)

EXPORT_INTERVAL_S = 5.0


class RayMetrics:
    """Mirrors proxy stats into Ray metrics. `metrics` is ray.util.metrics unless a test passes a stand-in."""

    def __init__(self, metrics: ModuleType | None = None):
        m = metrics or importlib.import_module("ray.util.metrics")
        self.in_flight = m.Gauge(IN_FLIGHT.name, IN_FLIGHT.help, tag_keys=IN_FLIGHT.labels)
        self.requests = m.Counter(REQUESTS.name, REQUESTS.help, tag_keys=REQUESTS.labels)
        self.active = m.Gauge(REPLICA_ACTIVE.name, REPLICA_ACTIVE.help, tag_keys=REPLICA_ACTIVE.labels)
        self.adapters_loaded = m.Gauge(
            ADAPTERS_LOADED.name, ADAPTERS_LOADED.help, tag_keys=ADAPTERS_LOADED.labels
        )
        self.routes = m.Counter(ROUTES.name, ROUTES.help, tag_keys=ROUTES.labels)
        self.retries = m.Counter(RETRIES.name, RETRIES.help, tag_keys=RETRIES.labels)
        self.adapters_routable = m.Gauge(
            ADAPTERS_ROUTABLE.name, ADAPTERS_ROUTABLE.help, tag_keys=ADAPTERS_ROUTABLE.labels
        )
        self.broadcast = m.Histogram(
            BROADCAST_SECONDS.name,
            BROADCAST_SECONDS.help,
            boundaries=list(LatencyHistogram.BUCKETS),
            tag_keys=BROADCAST_SECONDS.labels,
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
