"""rl_cluster.core.telemetry's definitions as ray.util.metrics, tagged with the run (a Ray default tag).

Ray's metrics agent on each node exports them to Prometheus (and so to the Ray dashboard's Grafana
panels, ray_configs/grafana/); recording is a local call that never blocks on the network.
"""

from __future__ import annotations

from ray.util import metrics as ray_metrics

from rl_cluster.core.telemetry import RUN_TAG, MetricDef


class RayMetricSet:
    """One actor's metrics: `definitions` created once, every series tagged `run=<run_name>`."""

    def __init__(self, definitions: tuple[MetricDef, ...], run_name: str):
        self._metrics = {}
        for d in definitions:
            tag_keys = (RUN_TAG, *d.tags)
            if d.kind == "histogram":
                metric = ray_metrics.Histogram(
                    d.name, d.help, boundaries=list(d.boundaries), tag_keys=tag_keys
                )
            elif d.kind == "counter":
                metric = ray_metrics.Counter(d.name, d.help, tag_keys=tag_keys)
            else:
                metric = ray_metrics.Gauge(d.name, d.help, tag_keys=tag_keys)
            metric.set_default_tags({RUN_TAG: run_name})
            self._metrics[d.name] = metric

    def set(self, name: str, value: float, **tags: str) -> None:
        self._metrics[name].set(value, tags=tags or None)

    def observe(self, name: str, value: float, **tags: str) -> None:
        self._metrics[name].observe(value, tags=tags or None)
