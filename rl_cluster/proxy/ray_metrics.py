"""The proxy's metrics as Ray metrics (ray.util.metrics), so the Ray dashboard and its Prometheus show them.

Only the ProxyActor uses this; ProxyServer knows nothing of Ray. Nothing is defined here: every metric
of rl_cluster.proxy.metrics.METRICS (those marked `ray`) becomes a Ray gauge or counter with the same
name, help and labels, refreshed from `ProxyServer.stats()` snapshots with the same sample functions
/metrics uses (counters advance by the difference since the last snapshot, since Ray counters only
increment). Broadcast latencies are forwarded one by one as they are observed.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from rl_cluster.core.telemetry import RUN_TAG
from rl_cluster.proxy.metrics import BROADCAST_SECONDS, METRICS

EXPORT_INTERVAL_S = 5.0


class RayMetrics:
    """Mirrors proxy stats into Ray metrics. `metrics` is ray.util.metrics unless a test passes a stand-in."""

    def __init__(self, metrics: ModuleType | None = None, run_name: str | None = None):
        """`run_name`: tags every series `run=<run_name>` (a Ray default tag), as the trainer's and the
        generators' metrics are (rl_cluster.core.telemetry)."""
        m = metrics or importlib.import_module("ray.util.metrics")
        kinds = {"gauge": m.Gauge, "counter": m.Counter}
        run = (RUN_TAG,) if run_name else ()
        self.by_name = {
            d.name: kinds[d.kind](d.name, d.help, tag_keys=d.labels + run) for d in METRICS if d.ray
        }
        h = BROADCAST_SECONDS
        self.broadcast = m.Histogram(h.name, h.help, boundaries=list(h.buckets), tag_keys=h.labels + run)
        if run_name:
            for metric in (*self.by_name.values(), self.broadcast):
                metric.set_default_tags({RUN_TAG: run_name})
        # Each counter sample's value at the last update.
        self._seen: dict[tuple[str, tuple[str, ...]], float] = {}

    def observe_broadcast(self, op: str, seconds: float) -> None:
        self.broadcast.observe(seconds, tags={"op": op})

    def update(self, stats: dict) -> None:
        """Bring every gauge and counter to the values of one `ProxyServer.stats()` snapshot."""
        for definition in METRICS:
            if not definition.ray:
                continue
            metric = self.by_name[definition.name]
            for values, value in definition.samples(stats).items():
                tags = dict(zip(definition.labels, values, strict=True)) or None
                if definition.kind == "gauge":
                    metric.set(value, tags=tags)
                else:
                    self._advance(metric, (definition.name, values), value, tags)

    def _advance(self, counter, key: tuple[str, tuple[str, ...]], value: float, tags: dict | None) -> None:
        # A count below the last one means the replica was removed and registered again: it counts anew.
        last = self._seen.get(key, 0)
        delta = value - last if value >= last else value
        if delta > 0:
            counter.inc(delta, tags=tags)
        self._seen[key] = value
