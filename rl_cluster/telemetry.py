"""rl_cluster.core.telemetry's definitions as ray.util.metrics, tagged with the run (a Ray default tag).

Ray's metrics agent on each node exports them to Prometheus (and so to the Ray dashboard's Grafana
panels, ray_configs/grafana/); recording is a local call that never blocks on the network.

Gauges are held. Ray 2.60 exports a gauge's series only while its process records it again within two
export intervals (`metrics_report_interval_ms`, 10 s by default; ray#56405 clears the agent's gauges at
each export so a dead worker's series end, ray#64633 keeps them for two intervals): a value set once, an
eval score or a served-vs-trained check, would be on the node's /metrics page for about 20 s and then
gone until the next one, and a step slower than 20 s would make every step gauge flicker. Prometheus's
own gauges keep their last value; so do ours: a daemon thread records every gauge series' last value
again each second. A series still ends with its process, as Ray intends.
"""

from __future__ import annotations

import threading

from ray.util import metrics as ray_metrics

from rl_cluster.core.telemetry import RUN_TAG, MetricDef

HOLD_EVERY_S = 1.0
"""Seconds between records of the held gauges: below Ray's smallest export interval (1 s)."""


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
        self._held: dict[tuple[str, tuple], float] = {}  # (name, tags) -> the gauge's last value
        self._lock = threading.Lock()
        self._holder: threading.Thread | None = None

    def set(self, name: str, value: float, **tags: str) -> None:
        with self._lock:
            self._metrics[name].set(value, tags=tags or None)
            self._held[(name, tuple(sorted(tags.items())))] = value
            if self._holder is None:
                self._holder = threading.Thread(target=self._hold, name="gauge-holder", daemon=True)
                self._holder.start()

    def observe(self, name: str, value: float, **tags: str) -> None:
        self._metrics[name].observe(value, tags=tags or None)

    def _hold(self) -> None:
        stopped = threading.Event()  # never set: the thread lives as long as its process
        while not stopped.wait(HOLD_EVERY_S):
            with self._lock:
                for (name, tags), value in self._held.items():
                    self._metrics[name].set(value, tags=dict(tags) or None)
