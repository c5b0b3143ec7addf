"""The trainer's and the generators' metric definitions (rl_cluster.core.telemetry) and their Ray form."""

from __future__ import annotations

import math

import pytest
from cluster.metric_names import all_metric_names

from rl_cluster.core.summary import step_record
from rl_cluster.core.telemetry import (
    GENERATOR_METRICS,
    STEP_GAUGES,
    STEP_HISTOGRAMS,
    TRAINER_METRICS,
    PrefixCacheCounts,
    step_values,
    vllm_gauges,
)
from rl_cluster.telemetry import RayMetricSet


def test_every_step_metric_reads_a_key_the_step_record_has():
    record = step_record(3, {}, 2, None)
    defined = {d.name: d.kind for d in TRAINER_METRICS}
    for name, key in STEP_GAUGES.items():
        assert key in record and defined[name] == "gauge", name
    for name, key in STEP_HISTOGRAMS.items():
        assert key in record and defined[name] == "histogram", name


def test_step_values_leave_out_what_a_step_did_not_log():
    logs = {"reward": 0.5, "loss": float("nan"), "perf/step_s": 1.25, "perf/trained_tok_s_wall_clock": 80.0}
    gauges, observed = step_values(step_record(7, logs, 4, 0.2))
    assert gauges == {"rl_trainer_step": 7.0, "rl_trainer_reward": 0.5, "rl_trainer_policy_version": 4.0,
                      "rl_trainer_trained_tokens_per_second": 80.0}  # fmt: skip
    assert observed == {"rl_trainer_step_seconds": 1.25}
    assert all(math.isfinite(v) for v in (*gauges.values(), *observed.values()))


def test_vllm_gauges_take_whichever_name_this_vllm_uses():
    assert vllm_gauges({"vllm:gpu_cache_usage_perc": 0.25, "vllm:num_requests_waiting": 2.0}) == {
        "rl_generator_kv_cache_usage": 0.25,
        "rl_generator_requests_waiting": 2.0,
    }
    assert vllm_gauges({"vllm:kv_cache_usage_perc": 0.5, "vllm:gpu_cache_usage_perc": 0.1}) == {
        "rl_generator_kv_cache_usage": 0.5
    }


def test_prometheus_names_carry_rays_prefix_and_suffixes():
    names = all_metric_names()
    assert "ray_rl_trainer_reward" in names
    assert "ray_rl_proxy_requests_total" in names and "ray_rl_proxy_requests" not in names
    assert {"ray_rl_trainer_staleness_bucket", "ray_rl_trainer_staleness_count"} <= names
    assert "ray_rl_proxy_in_flight" in names and "ray_rl_proxy_broadcast_seconds_bucket" in names
    assert "ray_rl_proxy_adapter_loaded" not in names  # per-adapter series stay off Ray (proxy.metrics)
    assert len({d.name for d in (*TRAINER_METRICS, *GENERATOR_METRICS)}) == len(TRAINER_METRICS) + len(
        GENERATOR_METRICS
    )


def test_real_ray_metrics_take_our_definitions_with_the_run_tag():
    """Constructing ray.util.metrics objects needs no running Ray; bad names or tag keys fail here."""
    metrics = RayMetricSet((*TRAINER_METRICS, *GENERATOR_METRICS), "my-run")
    reward = metrics._metrics["rl_trainer_reward"]
    assert reward.info["tag_keys"] == ("run",) and reward.info["default_tags"] == {"run": "my-run"}
    assert metrics._metrics["rl_generator_restarts"].info["tag_keys"] == ("run", "replica")
    with pytest.raises(ValueError, match="replica"):  # a per-replica series without its replica
        metrics.set("rl_generator_up", 1)


def test_prefix_cache_counts_add_up_across_server_restarts():
    counts = PrefixCacheCounts()
    assert counts.hit_rate is None
    counts.observe({"vllm:num_requests_running": 1.0})  # a page without the counters changes nothing
    counts.observe({"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 40.0})
    counts.observe({"vllm:prefix_cache_queries_total": 150.0, "vllm:prefix_cache_hits_total": 70.0})
    assert (counts.queries, counts.hits) == (150.0, 70.0)
    counts.restarted()  # a new server: its counters start from zero
    counts.observe({"vllm:prefix_cache_queries_total": 200.0, "vllm:prefix_cache_hits_total": 180.0})
    assert (counts.queries, counts.hits) == (350.0, 250.0)
    # A reading below the last one is a restart nobody announced (counted from zero as well).
    counts.observe({"vllm:prefix_cache_queries_total": 50.0, "vllm:prefix_cache_hits_total": 0.0})
    assert counts.as_dict() == {"queries": 400, "hits": 250, "hit_rate": 250 / 400}
