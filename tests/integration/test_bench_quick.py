"""`python -m bench --quick` end to end, so the benchmarks do not rot: every table is there, its numbers
are the ones in results.json, and they obey what must hold whatever the machine's speed (shares within
0..1, medians within their ranges, counts equal to the plan, a part never slower than its whole, the
prefix policy keeping GRPO groups together). Starts real vLLM servers, vllm-router, moto and Ray."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.__main__ import QUICK
from bench.common import GROUP_SIZE

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
VLLM_CPU_BLOCK = 128  # tokens per KV block in vLLM's CPU build: only whole blocks are prefix-cache hits

SECTIONS = {
    "## 1. Routing": 3,  # at least our three policies (vllm-router's two when it is installed)
    "## 2. Proxy overhead": 6,  # direct, the pass-through and ours under each of two loads
    "## 3. Handoff": 3,
    "## 4. Scaling": 2,
    "## 5. Asynchronous vs synchronous GRPO": 2,
    "## 6. Proxy capacity": 2,  # ours and the pass-through (and vllm-router when installed)
    "## 7. Experience store overhead": 2,  # on and off
    "## 8. Broadcast at scale": 3,  # a sync on 1, 8 and 32 stub replicas
    "## 9. Routing at scale": 2,  # ours, prefix and round robin (and vllm-router's two when installed)
    "## 10. The pool under a demand step": 2,  # one row per node-start delay
    "## 12. Trainer ranks: 1 vs 2, DDP vs FSDP2": 3,
}
LABEL_COLUMNS = {
    "## 2. Proxy overhead": 2,
    "## 12. Trainer ranks: 1 vs 2, DDP vs FSDP2": 2,
}  # path and load; mode
NUMBER = re.compile(r"[-+]?\d+(\.\d+)?")
PLOTS = (
    "routing",
    "overhead",
    "handoff",
    "scaling",
    "async_vs_sync",
    "broadcast",
    "routing_at_scale",
    "pool_step",
)


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first markdown table after `heading`."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    first_table = section.split("\n|", 1)[1].split("\n\n", 1)[0]
    lines = ("|" + first_table).splitlines()
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def share(x: float) -> bool:
    return 0.0 <= x <= 1.0


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One quick run for the module: (markdown text, results.json, output directory)."""
    out_dir = tmp_path_factory.mktemp("bench")
    out = out_dir / "BENCHMARKS.md"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"wrote {out}" in proc.stdout
    return out.read_text(), json.loads((out_dir / "results.json").read_text()), out_dir


def test_report_has_every_table_with_numbers_and_the_plots(bench_run):
    text, results, out_dir = bench_run
    assert "FAILED" not in text
    assert not [name for name, r in results.items() if isinstance(r, dict) and "error" in r]
    assert results["plan"] == json.loads(json.dumps(asdict(QUICK)))  # as results.json holds it (lists)
    for heading, min_rows in SECTIONS.items():
        assert heading in text, heading
        rows = table_rows(text, heading)
        assert len(rows) >= min_rows, (heading, rows)
        for row in rows:
            # The label columns aside, every cell holds a number ("-" marks a column that does not apply).
            values = [cell for cell in row[LABEL_COLUMNS.get(heading, 1) :] if cell != "-"]
            assert values and all(NUMBER.search(cell) for cell in values), (heading, row)
            assert not any("n/a" in cell or "nan" in cell.lower() for cell in row), (heading, row)
    # One table row per measured row, in the same order.
    for heading, key, label in (("## 1. Routing", "routing", "router"), ("## 2. Proxy overhead", "overhead", "path"),
                                ("## 3. Handoff", "handoff", "path")):  # fmt: skip
        assert [r[0] for r in table_rows(text, heading)] == [r[label] for r in results[key]["rows"]]
    assert "Machine: " in text and "vllm" in text and "command: `python -m bench --quick" in text
    for plot in PLOTS:
        assert (out_dir / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot


def test_routing_keeps_groups_together_and_obeys_the_cache_bound(bench_run):
    text, results, _ = bench_run
    routing = results["routing"]
    load = routing["load"]
    assert (load["groups"], load["group_size"]) == (QUICK.routing_groups, GROUP_SIZE)
    assert load["prompt_tokens"] > VLLM_CPU_BLOCK  # else no block of a prompt could ever be a cache hit
    # At best a group's first request computes its cached blocks and the other G-1 reuse them.
    cacheable = (load["prompt_tokens"] // VLLM_CPU_BLOCK) * VLLM_CPU_BLOCK / load["prompt_tokens"]
    best_hit_rate = (GROUP_SIZE - 1) / GROUP_SIZE * cacheable
    rows = {r["router"]: r for r in routing["rows"]}
    ours = {"rl_cluster proxy, prefix", "rl_cluster proxy, round_robin", "rl_cluster proxy, least_loaded"}
    assert ours <= set(rows)
    for label, r in rows.items():
        assert r["reps"] == QUICK.reps, label
        assert share(r["affinity"]) and share(r["cache_hit_rate"]), (label, r)
        assert 0.5 <= r["share_on_busier_replica"] <= 1.0, (label, r)  # two replicas
        assert r["cache_hit_rate"] <= best_hit_rate + 1e-9, (label, r, best_hit_rate)
        low, high = r["throughput_range"]
        assert 0 < low <= r["throughput"] <= high, (label, r)
        assert 0.05 < r["throughput_vs_ours"] < 20, (label, r)
    prefix, round_robin = rows["rl_cluster proxy, prefix"], rows["rl_cluster proxy, round_robin"]
    assert prefix["throughput_vs_ours"] == 1.0
    assert prefix["affinity"] >= 0.85  # the G samples of a group land on one replica (a rare spill aside)
    assert prefix["affinity"] > round_robin["affinity"]
    assert prefix["cache_hit_rate"] >= round_robin["cache_hit_rate"]
    (our_row,) = [row for row in table_rows(text, "## 1. Routing") if row[0] == "rl_cluster proxy, prefix"]
    assert our_row[1] == f"{100 * prefix['affinity']:.1f}%"


def test_overhead_and_scaling_are_measured_against_their_own_baseline(bench_run):
    _, results, _ = bench_run
    overhead = results["overhead"]["rows"]
    loads = list(dict.fromkeys(r["load"] for r in overhead))
    assert len(loads) == 2 and set(results["overhead"]["goal"]) == set(loads)
    for load in loads:
        rows = {r["path"]: r for r in overhead if r["load"] == load}
        direct, floor = rows["direct to vLLM"], rows["aiohttp pass-through (floor)"]
        assert (direct["throughput_vs_direct"], direct["added_p50_ms"]) == (1.0, 0.0)
        assert (floor["throughput_vs_floor"], floor["p50_vs_floor_ms"]) == (1.0, 0.0)
        assert "rl_cluster proxy" in rows
        for r in rows.values():
            assert r["reps"] == QUICK.reps * 8, r  # many short rounds (bench/overhead.py)
        goal = results["overhead"]["goal"][load]
        low, high = goal["throughput_vs_floor_middle"]
        assert low <= goal["throughput_vs_floor"] <= high, goal  # the median lies in the middle half
    for r in overhead:
        assert 0 < r["p50_ms"] <= r["p99_ms"], r
        assert 0.05 < r["throughput_vs_direct"] < 20, r
    scaling = results["scaling"]["rows"]
    assert [r["generators"] for r in scaling] == [1, 2]
    assert scaling[0]["speedup_vs_1"] == 1.0
    for r in scaling:
        assert r["reps"] == QUICK.reps
        low, high = r["throughput_range"]
        assert 0 < low <= r["throughput"] <= high, r
    assert 0.05 < scaling[1]["speedup_vs_1"] < 2.5  # two generators cannot beat twice one


def test_capacity_is_measured_against_the_same_stubs(bench_run):
    text, results, _ = bench_run
    capacity = results["capacity"]
    rows = {r["router"]: r for r in capacity["rows"]}
    ours = capacity["rows"][0]
    assert ours["router"].startswith("rl_cluster proxy") and ours["vs_ours"] == 1.0
    assert any(label.startswith("aiohttp pass-through") for label in rows)
    for r in rows.values():
        assert r["reps"] == QUICK.reps and r["requests_per_s"] > 0 and r["p50_ms"] > 0, r
        assert 0 < r["router_cpu_share"] <= 1.2, r  # pinned to one core (some slack for sampling)
    assert capacity["load"]["upstreams"] == QUICK.capacity_upstreams
    many = rows[f"rl_cluster proxy ({QUICK.capacity_many_upstreams} upstreams)"]  # ours again, more replicas
    assert f"{QUICK.capacity_many_upstreams} upstreams routes **{many['vs_ours']:.2f}x**" in text
    # The published run: 500 steps x 128 requests in 53 minutes over 4 replicas.
    assert capacity["seed"]["per_replica_rps"] == pytest.approx(500 * 128 / (53 * 60) / 4)
    fronted = ours["requests_per_s"] / capacity["seed"]["per_replica_rps"]
    assert f"One proxy process fronts about {fronted:,.0f} H200 replicas" in text


def test_handoff_parts_add_up(bench_run):
    _, results, _ = bench_run
    handoff = results["handoff"]
    rows = {r["path"]: r for r in handoff["rows"]}
    assert len(rows) == 3 and handoff["versions"] == QUICK.handoff_versions
    for path, r in rows.items():
        columns = {k: v for k, v in r.items() if k != "path"}
        expected = (
            {"load_s"}
            if path.startswith("direct vLLM")
            else {"publish_s", "verify_s", "load_s", "routable_s"}
        )
        assert set(columns) == expected, path
        for name, c in columns.items():
            assert c["n"] == QUICK.handoff_versions and 0 < c["p50_ms"] <= c["p95_ms"], (path, name, c)
        if "routable_s" in columns:  # routable = publish + load, version by version
            for part in ("publish_s", "load_s"):
                assert columns["routable_s"]["p50_ms"] >= columns[part]["p50_ms"], (path, part)
                assert columns["routable_s"]["p95_ms"] >= columns[part]["p95_ms"], (path, part)
    tiny, qwen = handoff["bytes"]["tiny"], handoff["bytes"]["qwen25_1p5b"]
    assert 0 < tiny["lora_bytes"] < tiny["full_bytes"] / 10
    assert qwen["lora_bytes_bf16"] < qwen["full_bytes_bf16"] / 100


def test_async_vs_sync_is_consistent(bench_run):
    text, results, _ = bench_run
    a = results["async_vs_sync"]
    assert (a["config"]["steps"], a["config"]["reps"]) == (QUICK.train_steps, QUICK.train_reps)
    sync, asyn = a["rows"]
    assert sync["mode"].startswith("synchronous") and asyn["mode"].startswith("asynchronous")
    for r in (sync, asyn):
        assert all(share(r[k]) for k in ("trainer_idle", "generator_idle", "dropped_share")), r
        assert share(r["reward_at_equal_time"]) and share(r["reward_last_fifth"]), r
        assert r["steps_per_hour"] == pytest.approx(3600 / r["mean_step_s"], rel=1e-6), r
        assert 0 <= r["rollout_wait_s"] <= r["mean_step_s"] and r["compute_s"] > 0, r
    assert sync["dropped_share"] == 0  # lockstep: every sample is trained on the policy that made it
    s = a["speedup"]
    assert (s["g_s"], s["t_s"]) == (sync["rollout_wait_s"], sync["compute_s"])
    assert 1.0 <= s["ideal"] <= 2.0  # (g + t) / max(g, t)
    assert s["share_of_ideal"] == pytest.approx(s["measured"] / s["ideal"])
    assert 0.1 < s["measured"] < 10
    assert len(a["curves"][sync["mode"]]) == len(a["curves"][asyn["mode"]]) == QUICK.train_steps
    assert (
        f"Speedup of asynchronous over synchronous: {s['measured']:.2f}x measured; ideal {s['ideal']:.2f}x"
        in text
    )


def test_the_experience_store_costs_are_measured_side_by_side(bench_run):
    text, results, _ = bench_run
    x = results["experience"]
    assert [r["setting"] for r in x["rows"]] == ["store on", "store off"]
    assert (x["config"]["steps"], x["config"]["reps"]) == (QUICK.train_steps, QUICK.train_reps)
    assert 0.2 < x["step_time_ratio"] < 5
    # Every trained sample was written (32 a step; more with those dropped or pulled after the last step).
    assert x["rows_per_step"] >= 32 and x["bytes_per_step"] > 0 and x["lost_rows"] == 0, x
    assert f"**{x['step_time_ratio']:.3f}×**" in text


def test_a_broadcast_is_timed_on_each_fleet_size_against_one_replica(bench_run):
    _, results, _ = bench_run
    broadcast = results["broadcast"]
    rows = broadcast["rows"]
    assert [r["replicas"] for r in rows] == list(QUICK.broadcast_sizes) and rows[0]["replicas"] == 1
    assert all(r["syncs"] == QUICK.broadcast_versions for r in rows)
    # No sync beats the slowest of its replicas' loads, each at least 0.8 x load_ms.
    assert all(r["max_s"] >= r["p50_s"] >= 0.8 * broadcast["load_ms"] / 1000 for r in rows), rows
    assert rows[0]["vs_one_replica"] == 1.0 and rows[0]["per_extra_replica_ms"] is None
    assert all(abs(r["vs_one_replica"] - r["p50_s"] / rows[0]["p50_s"]) < 1e-9 for r in rows)
    # The proxy does a load, a /v1/models check and an unload per replica per sync: more replicas, more CPU.
    assert rows[-1]["proxy_cpu_ms_per_sync"] > rows[0]["proxy_cpu_ms_per_sync"], rows
    assert all(0.0 <= r["fleet_cpu_share"] <= 1.5 for r in rows), rows  # one core, and psutil's tick


def test_at_scale_the_engines_hit_their_prefix_caches_behind_prefix_routing(bench_run):
    _, results, _ = bench_run
    section = results["routing_at_scale"]
    rows = {r["router"]: r for r in section["rows"]}
    assert section["load"]["replicas"] == QUICK.scale_routing_replicas
    ours, spread = rows["rl_cluster proxy, prefix"], rows["rl_cluster proxy, round_robin"]
    assert all(r["reps"] == QUICK.reps and share(r["cache_hit_rate"]) for r in rows.values()), rows
    # A group's G requests on one replica: G - 1 of them find its whole prompt cached. Spread over the
    # replicas, each member is the first of its group there: only the shared system prompt hits.
    assert ours["cache_hit_rate"] > spread["cache_hit_rate"] + 0.2, rows
    assert spread["requests_max_over_mean"] < ours["requests_max_over_mean"] + 1e-9, rows
    assert spread["replicas_used"] == QUICK.scale_routing_replicas, rows


def test_the_pool_step_section_has_a_row_per_node_start_delay(bench_run):
    text, results, _ = bench_run
    rows = results["pool_step"]["rows"]
    assert [r["node_start_s"] for r in rows] == list(QUICK.pool_step_delays)
    assert all(r["served_after_s"] is not None and r["served_after_s"] >= r["node_start_s"] for r in rows), (
        rows
    )
    assert "| 30 | 6 | 6 | +0 |" in text


def test_fsdp2_ranks_hold_half_of_the_weights_and_ddp_ranks_all_of_them(bench_run):
    _, results, _ = bench_run
    rows = {r["config"]: r for r in results["trainer_ranks"]["rows_by_config"]}
    assert {c: r["distributed"] for c, r in rows.items()} == {
        "1 rank": "NO", "2 ranks, DDP": "MULTI_CPU", "2 ranks, FSDP2": "FSDP"
    }  # fmt: skip
    whole = rows["1 rank"]["whole"]
    assert all(
        r["whole"] == whole and r["samples_per_s"] > 0 and r["peak"] >= r["resident"] for r in rows.values()
    )
    assert rows["1 rank"]["held"] == rows["2 ranks, DDP"]["held"] == whole
    assert 0.45 * whole < rows["2 ranks, FSDP2"]["held"] < 0.55 * whole
