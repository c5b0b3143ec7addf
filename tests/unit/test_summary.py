import pytest

from rl_cluster.core.summary import (
    exit_status,
    fifths,
    progress_line,
    served_check_summary,
    step_record,
    summarize,
    summary_table,
)


def history(rewards):
    return [
        step_record(
            i + 1, {"reward": r, "sample/staleness_mean": 1.0, "sample/dropped_stale_total": 2.0}, i, 0.1
        )
        for i, r in enumerate(rewards)
    ]


def test_fifths_average_whole_fifths_not_single_steps():
    assert fifths([0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]) == (0.0, 1.0)
    assert fifths([0.5]) == (0.5, 0.5)
    assert fifths([0.2, None, 0.4]) == (0.2, 0.4)


def test_progress_line_names_what_a_step_did():
    line = progress_line(history([0.25])[0], 150)
    assert line.startswith("step    1/150") and "reward 0.250" in line and "policy v0" in line
    assert "handoff 0.100s" in line
    assert "reward -" in progress_line(step_record(3, {}, 1, None), 10)


def test_summary_has_the_documented_fields():
    result = {
        "history": history([0.1] * 5 + [0.6] * 5),
        "syncs": [
            {"version": 1, "adapter": "r-v1", "handoff_s": 0.2, "served_vs_trained_gap": 1e-7},
            {"version": 2, "adapter": "r-v2", "handoff_s": 0.4},
            {
                "version": 3,
                "adapter": "r-v3",
                "handoff_s": 0.3,
                "served_vs_trained_gap": 3e-7,
                "check": {"verdict": "match", "replicas": [{"floor": 2e-7, "distance": 3e-7}]},
            },
        ],
    }
    stats = {
        "replicas": {
            "g0": {"requests": 10, "adapters_ever_loaded": ["r-v2", "r-v1", "r-v3"]},
            "g1": {"requests": 7, "adapters_ever_loaded": ["r-v1", "r-v2", "r-v3"]},
        },
        "routing": {"affinity": 5, "spill": 1, "unmatched": 2},
    }
    s = summarize(result, stats, 12.34)
    assert s["steps"] == 10 and s["wall_time_s"] == 12.3
    assert (s["reward_first_fifth"], s["reward_last_fifth"]) == (0.1, 0.6)
    assert s["versions_published"] == ["r-v1", "r-v2", "r-v3"]
    assert s["versions_loaded"]["g0"] == ["r-v1", "r-v2", "r-v3"]
    assert s["requests"] == {"g0": 10, "g1": 7}
    assert s["served_vs_trained_gap"] == 3e-7 and s["served_check"]["match"] == 1
    assert s["handoff_s_p50"] == 0.3
    assert s["dropped_stale_samples"] == 20
    assert s["routing"]["affinity"] == 5
    assert s["trainer_idle"] is None  # no step timings in this history
    table = summary_table(s)
    assert "reward, last fifth     0.600" in table and "replica g1" in table
    assert "routing                5 affinity (62.5%), 1 spill (12.5%), 2 unmatched (25.0%)" in table
    assert "trainer idle           - of step time" in table
    assert "served vs trained      1 match; gap 3.00e-07, rounding floor 2.00e-07 (largest)" in table


def test_trainer_idle_is_the_share_of_step_time_spent_waiting_over_timed_steps():
    logs = [{"perf/rollout_wait_s": 8.0}]  # step 1: start-up, which TRL does not time: left out
    logs += [
        {"perf/step_s": 2.0, "perf/rollout_wait_s": 0.5},
        {"perf/step_s": 2.0, "perf/rollout_wait_s": 0.0},
    ]
    records = [step_record(i + 1, log, i, None) for i, log in enumerate(logs)]
    s = summarize({"history": records, "syncs": []}, {}, 20.0)
    assert s["trainer_idle"] == 0.125
    assert "trainer idle           12.5% of step time waiting for rollouts" in summary_table(s)


def test_a_run_that_did_not_finish_is_summarised_with_what_it_did():
    result = {
        "history": history([0.2, 0.3, 0.4]),
        "syncs": [{"version": 1, "adapter": "r-v1", "handoff_s": 0.1}],
    }
    placement = {
        "trainer": {"address": "10.0.0.2", "node_id": "n2"},
        "proxy": {"address": "10.0.0.1", "node_id": "n1"},
    }
    s = summarize(result, {}, 5.0, status="stopped", placement=placement, replica_restarts={"g0": 2, "g1": 0})
    assert (s["status"], s["steps"], s["requests"]) == ("stopped", 3, {})
    assert s["placement"]["trainer"]["address"] == "10.0.0.2"
    assert s["replica_restarts"] == {"g0": 2, "g1": 0}
    assert "replica restarts       g0 2" in summary_table(s)
    table = summary_table(s)
    assert "status                 stopped" in table and "trainer on             10.0.0.2" in table
    failed = summarize(result, {}, 5.0, status="failed", error="RuntimeError: boom")
    assert "failed: RuntimeError: boom" in summary_table(failed)


def test_the_table_says_where_each_trainer_rank_runs():
    placement = {"trainer": {"address": "10.0.0.2", "node_id": "n2", "pid": 71}}
    s = summarize({"history": history([0.2, 0.3]), "syncs": []}, {}, 5.0, placement=placement)
    s["trainer_ranks"] = [{"address": "10.0.0.2", "node_id": "n2", "pid": 71},
                          {"address": "10.0.0.3", "node_id": "n3", "pid": 72}]  # fmt: skip
    rows = [" ".join(line.split()) for line in summary_table(s).splitlines()]
    assert "trainer rank 0/2 10.0.0.2 (pid 71)" in rows and "trainer rank 1/2 10.0.0.3 (pid 72)" in rows
    assert not any(row.startswith("trainer on") for row in rows)  # the ranks' rows say it


def test_exit_status_tells_success_mismatch_and_failure_apart():
    def summary(status="finished", *verdicts):
        syncs = [{"check": {"verdict": v, "replicas": [{"floor": 1e-3, "distance": 2e-3}]}} for v in verdicts]
        return {"status": status, "served_check": served_check_summary(syncs)}

    assert exit_status(summary("finished", "match")) == 0
    # Too close to tell is counted, never a failure; but some check must have answered.
    assert exit_status(summary("finished", "too_close", "too_close")) == 0
    assert (
        exit_status(summary("finished", "match", "mismatch")) == 3
    )  # served != trained (2: refused to start)
    assert exit_status(summary("finished")) == 3  # never checked: not a success
    assert exit_status(summary("stopped", "match")) == 1
    assert exit_status(summary("failed")) == 1


def test_the_check_summary_counts_verdicts_and_keeps_the_largest_floor():
    syncs = [
        {"version": 1},
        {"check": {"verdict": "too_close", "replicas": [{"floor": 2e-3, "distance": 1e-3}]}},
        {"check": {"verdict": "match", "replicas": [{"floor": 5e-3, "distance": 4e-3}, {"floor": 1e-3,
                                                                                          "distance": 9e-3}]}},
    ]  # fmt: skip
    out = served_check_summary(syncs)
    assert out == {
        "checks": 2,
        "match": 1,
        "too_close": 1,
        "mismatch": 0,
        "floor_max": 5e-3,
        "distance_max": 9e-3,
    }
    assert served_check_summary([])["floor_max"] is None


def test_the_engines_prefix_cache_hit_rate_is_summed_over_replicas_and_printed():
    counts = {
        "g0": {"queries": 300, "hits": 240, "hit_rate": 0.8},
        "g1": {"queries": 100, "hits": 20, "hit_rate": 0.2},
    }
    s = summarize({"history": history([0.5]), "syncs": []}, {}, 1.0, prefix_cache=counts)
    assert s["prefix_cache"] == {"hit_rate": 0.65, "replicas": counts}
    table = summary_table(s)
    assert (
        "prefix cache hits" in table
        and "65.0% of prompt tokens found in vLLM's cache (g0 80.0%, g1 20.0%)" in table
    )
    # No lookups yet (or no replica answered): no rate, and the table says so.
    empty = summarize({"history": history([0.5]), "syncs": []}, {}, 1.0)
    assert empty["prefix_cache"] == {"hit_rate": None, "replicas": {}}
    assert [line for line in summary_table(empty).splitlines() if "prefix cache hits" in line][0].endswith(
        "-"
    )


def test_versions_loaded_joins_what_the_proxy_saw_and_what_each_generator_says():
    # The proxy was restarted after v2: it saw only v3 on g0; g0's own record has all three.
    stats = {"replicas": {"g0": {"requests": 3, "adapters_ever_loaded": ["r-v3"]}}}
    own = {"g0": ["r-v1", "r-v2", "r-v3"], "g1": ["r-v1"]}  # g1 answered its actor, not the proxy
    s = summarize({"history": history([0.5]), "syncs": []}, stats, 1.0, replica_versions=own)
    assert s["versions_loaded"] == {"g0": ["r-v1", "r-v2", "r-v3"], "g1": ["r-v1"]}
    assert "replica g0             3 requests, 3 versions loaded" in summary_table(s)


def test_the_correction_summary_reads_the_steps_ratios_and_counts_nonfinite_tokens():
    logs = [
        {"correction/ratio_mean": 1.01, "correction/ratio_max": 1.4, "correction/share_corrected": 0.0},
        {"correction/ratio_mean": 0.99, "correction/ratio_max": 3.5, "correction/share_corrected": 0.02,
         "correction/nonfinite_total": 2.0},
    ]  # fmt: skip
    history = [step_record(i + 1, log, i, None) for i, log in enumerate(logs)]
    out = summarize({"history": history, "syncs": [], "correction": "tis"}, {}, 1.0)["correction"]
    assert out == {"method": "tis", "ratio_mean": pytest.approx(1.0), "ratio_max": 3.5,
                   "share_corrected": pytest.approx(0.01), "nonfinite_tokens": 2}  # fmt: skip
    assert "tis: pi_train/pi_vllm mean 1.0000, max 3.500; 1.00% of tokens corrected" in summary_table(
        summarize({"history": history, "syncs": [], "correction": "tis"}, {}, 1.0)
    )
