"""The trainer's and the generators' metrics for the Ray dashboard: defined once here, created as
ray.util.metrics by `rl_cluster.telemetry`, named in the Grafana dashboard (ray_configs/grafana/).

Pure: names, kinds, help, tags and histogram boundaries, and which values of a step record, a sync
record, a group count or a vLLM /metrics page each metric takes. Every metric carries the `run` tag (a
Ray default tag, set once per actor), so runs sharing a cluster stay apart; per-replica metrics carry
`replica` too. The proxy's own metrics are defined beside its /metrics page (rl_cluster.proxy.metrics).
Ray exports each metric to Prometheus with a `ray_` prefix, and counters with a `_total` suffix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

RUN_TAG = "run"


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Literal["gauge", "counter", "histogram"]
    help: str
    tags: tuple[str, ...] = ()
    """Tag keys besides `run`."""
    boundaries: tuple[float, ...] = ()
    """Histogram bucket boundaries."""


SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STALENESS = (0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5)  # integer versions: one bucket each up to 4

# Gauges set from each step record: metric name -> key of rl_cluster.core.summary.step_record.
STEP_GAUGES = {
    "rl_trainer_step": "step",
    "rl_trainer_reward": "reward",
    "rl_trainer_policy_version": "policy_version",
    "rl_trainer_loss": "loss",
    "rl_trainer_trained_tokens_per_second": "trained_tok_s",
    "rl_trainer_generated_tokens_per_second": "generated_tok_s",
}
STEP_HISTOGRAMS = {"rl_trainer_step_seconds": "step_s", "rl_trainer_rollout_wait_seconds": "rollout_wait_s"}
GROUP_FATES = ("generated", "trained", "dropped_stale", "failed")

TRAINER_METRICS = (
    MetricDef("rl_trainer_step", "gauge", "Optimizer steps done."),
    MetricDef("rl_trainer_reward", "gauge", "Mean reward of the step's samples."),
    MetricDef("rl_trainer_policy_version", "gauge", "Adapter version new rollout groups ask for."),
    MetricDef("rl_trainer_loss", "gauge", "GRPO loss of the step."),
    MetricDef("rl_trainer_trained_tokens_per_second", "gauge", "Tokens trained per second of wall clock."),
    MetricDef("rl_trainer_generated_tokens_per_second", "gauge", "Tokens the rollout loop received per second."),
    MetricDef("rl_trainer_step_seconds", "histogram", "Seconds per optimizer step.", boundaries=SECONDS),
    MetricDef("rl_trainer_rollout_wait_seconds", "histogram", "Seconds a step waited for rollouts.",
              boundaries=SECONDS),
    MetricDef("rl_trainer_handoff_seconds", "histogram",
              "Seconds from the adapter saved to it routable on every replica.", boundaries=SECONDS),
    MetricDef("rl_trainer_staleness", "histogram",
              "Versions between the policy a sample was generated under and the trainer's at its pull.",
              boundaries=STALENESS),
    MetricDef("rl_trainer_served_vs_trained_gap", "gauge",
              "Largest mean absolute logprob gap between a replica's serving and the trainer's weights."),
    MetricDef("rl_trainer_served_vs_trained_floor", "gauge",
              "The model dtype's rounding of the same logprobs, measured by the served-vs-trained check."),
    # Gauges of the run's totals, not counters: a resumed trainer starts from the checkpoint's totals.
    MetricDef("rl_trainer_groups", "gauge", "Rollout groups of the run so far by fate: generated, trained, "
              "dropped_stale, failed.", ("fate",)),
    MetricDef("rl_trainer_eval", "gauge", "Held-out eval of the newest version (pass@1, mean@k).", ("score",)),
)  # fmt: skip

# vLLM's own gauges a generator re-exports per replica: our name -> the names vLLM may use for it.
VLLM_GAUGES = {
    "rl_generator_kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "rl_generator_requests_running": ("vllm:num_requests_running",),
    "rl_generator_requests_waiting": ("vllm:num_requests_waiting",),
}

GENERATOR_METRICS = (
    MetricDef("rl_generator_adapters_loaded", "gauge", "Adapter versions loaded on the replica.", ("replica",)),
    MetricDef("rl_generator_restarts", "gauge", "Restarts of the replica's vLLM server so far.", ("replica",)),
    MetricDef("rl_generator_up", "gauge", "1 while the replica's vLLM server answers /metrics.", ("replica",)),
    MetricDef("rl_generator_kv_cache_usage", "gauge", "vLLM's KV cache usage (0..1).", ("replica",)),
    MetricDef("rl_generator_requests_running", "gauge", "Requests vLLM is running.", ("replica",)),
    MetricDef("rl_generator_requests_waiting", "gauge", "Requests waiting in vLLM's queue.", ("replica",)),
    MetricDef("rl_generator_prefix_cache_hit_rate", "gauge", "vLLM's own prefix-cache hit rate on the "
              "replica over the run so far: prompt tokens its cache served / prompt tokens it looked up.",
              ("replica",)),
)  # fmt: skip

# vLLM's prefix-cache counters, in prompt tokens: looked up in the cache, and found there.
VLLM_PREFIX_CACHE = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


@dataclass
class PrefixCacheCounts:
    """One replica's vLLM prefix-cache counters over the run. The engine's own number, not the proxy's:
    routing can look right (a request went where its prefix should be) while the cache misses.

    A server's counters start from zero when it restarts: each reading adds what they grew since the
    previous one, and after `restarted()` (or a reading below the previous one) all of it."""

    queries: float = 0.0
    hits: float = 0.0
    _last: tuple[float, float] = (0.0, 0.0)

    def observe(self, samples: dict[str, float]) -> None:
        """Take one reading of the server's /metrics (sample name -> value, summed over label sets)."""
        if not all(name in samples for name in VLLM_PREFIX_CACHE):
            return
        queries, hits = (samples[name] for name in VLLM_PREFIX_CACHE)
        last_queries, last_hits = self._last if queries >= self._last[0] else (0.0, 0.0)
        self.queries += queries - last_queries
        self.hits += max(hits - last_hits, 0.0)
        self._last = (queries, hits)

    def restarted(self) -> None:
        """The server was started anew: its next reading counts from zero."""
        self._last = (0.0, 0.0)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None

    def as_dict(self) -> dict:
        return {"queries": int(self.queries), "hits": int(self.hits), "hit_rate": self.hit_rate}


def finite(value) -> float | None:
    """`value` as a float when it is a finite number, else None (a gauge is not set to NaN or None)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def step_values(record: dict) -> tuple[dict[str, float], dict[str, float]]:
    """(gauges, histogram observations) of one step record, by metric name; missing values are left out."""
    gauges = {name: v for name, key in STEP_GAUGES.items() if (v := finite(record.get(key))) is not None}
    observed = {
        name: v for name, key in STEP_HISTOGRAMS.items() if (v := finite(record.get(key))) is not None
    }
    return gauges, observed


def vllm_gauges(samples: dict[str, float]) -> dict[str, float]:
    """Our generator gauges from vLLM's /metrics samples (name -> value, summed over label sets)."""
    out = {}
    for ours, theirs in VLLM_GAUGES.items():
        for name in theirs:
            if name in samples:
                out[ours] = samples[name]
                break
    return out
