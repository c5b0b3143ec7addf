"""Every metric name rl_cluster exports to Ray, for the tests that check dashboards and scrapes against it.

Here rather than in the package: it joins the pure definitions (rl_cluster.core.telemetry) with the proxy's
(rl_cluster.proxy.metrics), and nothing in the package needs the union.
"""

from __future__ import annotations

from rl_cluster.core.telemetry import GENERATOR_METRICS, TRAINER_METRICS, MetricDef
from rl_cluster.proxy.metrics import BROADCAST_SECONDS, METRICS


def all_metric_names() -> set[str]:
    """Every metric name rl_cluster exports to Ray, as Prometheus sees it (`ray_` prefix, `_total` on
    counters; a histogram as `_bucket`, `_count` and `_sum`)."""
    defs = [*TRAINER_METRICS, *GENERATOR_METRICS]
    defs += [MetricDef(m.name, m.kind, m.help) for m in METRICS if m.ray]
    defs.append(MetricDef(BROADCAST_SECONDS.name, "histogram", BROADCAST_SECONDS.help))
    names = set()
    for d in defs:
        base = f"ray_{d.name}"
        if d.kind == "counter":
            names.add(base + "_total")
        elif d.kind == "histogram":
            names.update({base + "_bucket", base + "_count", base + "_sum"})
        else:
            names.add(base)
    return names
