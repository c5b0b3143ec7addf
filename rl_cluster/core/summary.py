"""What a run shows: one progress line per step, and the summary at the end. Pure functions."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from rl_cluster.core.evaluation import eval_summary
from rl_cluster.core.served_check import Verdict

VERDICTS = tuple(v.value for v in Verdict)


def step_record(step: int, logs: dict, policy_version: int, handoff_s: float | None) -> dict:
    """The per-step metrics we keep (one line of metrics.jsonl), from TRL's logged dict."""
    return {
        "step": step,
        "reward": logs.get("reward"),
        "staleness": logs.get("sample/staleness_mean"),
        "policy_version": policy_version,
        "handoff_s": handoff_s,
        "dropped_stale": logs.get("sample/dropped_stale_total") or 0.0,
        "loss": logs.get("loss"),
        # Trainer vs sampler on the same tokens (TRL's estimate); ~0 while the policy has not moved.
        "kl": logs.get("kl"),
        "step_s": logs.get("perf/step_s"),
        "rollout_wait_s": logs.get("perf/rollout_wait_s"),
        "trained_tok_s": logs.get("perf/trained_tok_s_wall_clock"),
        "generated_tok_s": logs.get("rollout/generated_tok_s"),
        # What the step trained: completions_per_step samples, in as many forwards as token_budget needs.
        "samples": logs.get("batch/samples_per_step"),
        "microbatches": logs.get("batch/microbatches_per_step"),
        # The off-policy correction's view of the step (rl_cluster.trainer.correction): pi_train / pi_vllm
        # per token, and the share of tokens it truncated or masked.
        "ratio_mean": logs.get("correction/ratio_mean"),
        "ratio_max": logs.get("correction/ratio_max"),
        "share_corrected": logs.get("correction/share_corrected"),
        "nonfinite_tokens": logs.get("correction/nonfinite_total") or 0.0,  # vLLM logprob -inf or NaN
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


# Lines a run prints that must each reach the job's logs (Ray's RAY_DEDUP_LOGS_ALLOW_REGEX). Ray's
# driver collapses lines that differ only in their numbers when several sources print them ("[repeated
# 16x across cluster]"), which would swallow progress lines.
NEVER_DEDUPLICATED = (
    r"step +\d+/\d+  reward|checkpoint step \d+ published|SERVED != TRAINED|eval step +\d+  pass@1"
)


def progress_line(record: dict, max_steps: int) -> str:
    return (
        f"step {record['step']:>4}/{max_steps}  reward {_fmt(record['reward'], '.3f')}  "
        f"staleness {_fmt(record['staleness'], '.2f')}  policy v{record['policy_version']}  "
        f"handoff {_fmt(record['handoff_s'], '.3f')}s"
    )


def finite_mean(values: Iterable[float | None]) -> float | None:
    """Mean of the values that are numbers (None and NaN left out); None when none is."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def fifths(values: list[float]) -> tuple[float | None, float | None]:
    """Mean of the first and of the last fifth (at least one value each)."""
    k = max(1, len(values) // 5)
    return finite_mean(values[:k]), finite_mean(values[-k:])


def trainer_idle(history: list[dict]) -> float | None:
    """Share of the trainer's step time spent waiting for rollouts. Over the steps TRL timed: a run's
    first step (and a resumed run's) has no step time, and its wait is start-up, not the run's balance.
    None without timings."""
    timed = [r for r in history if r.get("step_s")]
    total = sum(r["step_s"] for r in timed)
    return sum(r["rollout_wait_s"] or 0.0 for r in timed) / total if total > 0 else None


def summarize(
    trainer_result: dict,
    proxy_stats: dict,
    wall_time_s: float,
    status: str = "finished",
    error: str | None = None,
    placement: dict | None = None,
    replica_restarts: dict | None = None,
    scale_events: list[dict] | None = None,
    prefix_cache: dict[str, dict] | None = None,
    replica_versions: dict[str, list[str]] | None = None,
) -> dict:
    """`status`: finished, stopped (a signal, `ray job stop`) or failed (`error` says why); a run that did
    not finish is summarised with what it did. `placement`: actor -> {address, node_id}.
    `replica_versions`: the versions each generator says it loaded; with what the proxy saw, they make
    `versions_loaded` (a restarted proxy saw only what came after it)."""
    history, syncs = trainer_result["history"], trainer_result["syncs"]
    first, last = fifths([r["reward"] for r in history])
    handoffs = [s["handoff_s"] for s in syncs]
    gaps = [s["served_vs_trained_gap"] for s in syncs if "served_vs_trained_gap" in s]
    replicas = proxy_stats.get("replicas", {})
    return {
        "status": status,
        "error": error,
        "steps": len(history),
        "wall_time_s": round(wall_time_s, 1),
        "reward_first_fifth": first,
        "reward_last_fifth": last,
        "versions_published": [s["adapter"] for s in syncs],
        "versions_loaded": versions_loaded(replicas, replica_versions or {}),
        "requests": {rid: r["requests"] for rid, r in replicas.items()},
        "served_vs_trained_gap": max(gaps) if gaps else None,
        # The checks' verdicts (rl_cluster.core.served_check): counts, and the largest floor and distance.
        "served_check": served_check_summary(syncs),
        "correction": correction_summary(trainer_result.get("correction", "none"), history),
        "handoff_s_p50": statistics.median(handoffs) if handoffs else None,
        "handoff_s_max": max(handoffs) if handoffs else None,
        "dropped_stale_samples": int(sum(r["dropped_stale"] for r in history)),
        "groups": trainer_result.get("groups", {}),
        "mean_staleness": finite_mean([r["staleness"] for r in history]),
        "trainer_idle": trainer_idle(history),
        "routing": proxy_stats.get("routing", {}),
        # vLLM's own prefix-cache counters per replica (what routing is for): prompt tokens looked up, found.
        "prefix_cache": engine_prefix_cache(prefix_cache or {}),
        "checkpoints": trainer_result.get("checkpoints", []),
        "placement": placement or {},
        "replica_restarts": replica_restarts or {},
        # The pool controller's changes (rl_cluster.core.scaling.ScaleEvent.as_dict): time, from, to, reason,
        # first_request_s (decision -> the new replica's first routed request), drain per removed replica.
        "scale_events": scale_events or [],
        # Held-out evals (rl_cluster.core.evaluation.eval_summary): first, last, pass@1 / mean@k per step.
        "eval": eval_summary(trainer_result.get("evals", [])),
    }


def versions_loaded(proxy_replicas: dict[str, dict], replica_versions: dict[str, list[str]]) -> dict:
    """Per replica, every version it loaded: what the proxy saw and what the generator itself says."""
    rids = [*proxy_replicas, *(r for r in replica_versions if r not in proxy_replicas)]
    return {
        rid: sorted(
            set(proxy_replicas.get(rid, {}).get("adapters_ever_loaded", []))
            | set(replica_versions.get(rid, []))
        )
        for rid in rids
    }


def engine_prefix_cache(per_replica: dict[str, dict]) -> dict:
    """{"hit_rate": over every replica (None before any lookup), "replicas": {replica: counts}}."""
    queries = sum(c["queries"] for c in per_replica.values())
    hits = sum(c["hits"] for c in per_replica.values())
    return {"hit_rate": hits / queries if queries else None, "replicas": dict(per_replica)}


def served_check_summary(syncs: list[dict]) -> dict:
    """{"checks", "match", "too_close", "mismatch": syncs by verdict; "floor_max", "distance_max": over
    every replica checked (None before any check)}."""
    checks = [s["check"] for s in syncs if "check" in s]
    replicas = [r for c in checks for r in c["replicas"]]
    out = {"checks": len(checks), **{v: sum(c["verdict"] == v for c in checks) for v in VERDICTS}}
    for key in ("floor", "distance"):
        out[f"{key}_max"] = max((r[key] for r in replicas), default=None)
    return out


def correction_summary(method: str, history: list[dict]) -> dict:
    """The off-policy correction over the run: `method`; the steps' mean ratio pi_train / pi_vllm, its
    largest, the mean share of tokens truncated or masked (None before any step), and the tokens whose
    vLLM logprob was -inf or NaN (masked under tis and icepop)."""
    ratio_max = [r["ratio_max"] for r in history if r.get("ratio_max") is not None]
    return {
        "method": method,
        "ratio_mean": finite_mean(r.get("ratio_mean") for r in history),
        "ratio_max": max(ratio_max) if ratio_max else None,
        "share_corrected": finite_mean(r.get("share_corrected") for r in history),
        "nonfinite_tokens": int(sum(r.get("nonfinite_tokens") or 0 for r in history)),
    }


def exit_status(summary: dict) -> int:
    """0: finished and served = trained; 3: finished but a replica did not serve the trained adapter (or
    no check answered); 1: stopped or failed. A check too close to tell is no failure. (2 is every entry
    point's "refused before it started": a config that does not load, data not prepared, a run name
    taken; rl_cluster.cli.)"""
    if summary["status"] != "finished":
        return 1
    checks = summary["served_check"]
    return 0 if checks["checks"] and not checks["mismatch"] else 3


def _groups_line(groups: dict) -> str:
    if not groups:
        return "-"
    generated = groups["generated"]
    share = f" ({groups['dropped_stale'] / generated:.1%} of generated)" if generated else ""
    return (
        f"{generated} generated, {groups['trained']} trained, {groups['dropped_stale']} dropped stale{share}, "
        f"{groups['failed']} failed"
    )


def _correction_line(correction: dict) -> str:
    if not correction:
        return "-"
    return (
        f"{correction['method']}: pi_train/pi_vllm mean {_fmt(correction['ratio_mean'], '.4f')}, max "
        f"{_fmt(correction['ratio_max'], '.3f')}; {_fmt(correction['share_corrected'], '.2%')} of tokens corrected"
        + (f"; {n} with a non-finite vLLM logprob" if (n := correction.get("nonfinite_tokens")) else "")
    )


def _check_line(checks: dict, gap: float | None) -> str:
    if not checks.get("checks"):
        return "never checked"
    counts = ", ".join(f"{checks[v]} {v.replace('_', ' ')}" for v in VERDICTS if checks[v])
    return f"{counts}; gap {_fmt(gap, '.2e')}, rounding floor {_fmt(checks['floor_max'], '.2e')} (largest)"


def _prefix_cache_line(cache: dict) -> str:
    if cache.get("hit_rate") is None:
        return "-"
    each = ", ".join(f"{rid} {_fmt(c['hit_rate'], '.1%')}" for rid, c in cache["replicas"].items())
    return f"{cache['hit_rate']:.1%} of prompt tokens found in vLLM's cache ({each})"


def _routing_line(routing: dict) -> str:
    total = sum(routing.values())
    if not total:
        return "-"
    return ", ".join(f"{routing[reason]} {reason} ({routing[reason] / total:.1%})" for reason in routing)


def summary_table(summary: dict) -> str:
    rows = [
        ("status", summary["status"] + (f": {summary['error']}" if summary.get("error") else "")),
        ("steps", summary["steps"]),
        ("wall time", f"{summary['wall_time_s']:.0f} s"),
        ("reward, first fifth", _fmt(summary["reward_first_fifth"], ".3f")),
        ("reward, last fifth", _fmt(summary["reward_last_fifth"], ".3f")),
        ("versions published", len(summary["versions_published"])),
        (
            "served vs trained",
            _check_line(summary.get("served_check") or {}, summary["served_vs_trained_gap"]),
        ),
        (
            "handoff p50 / max",
            f"{_fmt(summary['handoff_s_p50'], '.3f')} / {_fmt(summary['handoff_s_max'], '.3f')} s",
        ),
        ("dropped stale samples", summary["dropped_stale_samples"]),
        ("groups", _groups_line(summary.get("groups") or {})),
        ("mean staleness", _fmt(summary["mean_staleness"], ".2f")),
        ("correction", _correction_line(summary.get("correction") or {})),
        ("trainer idle", _fmt(summary.get("trainer_idle"), ".1%") + " of step time waiting for rollouts"),
        ("routing", _routing_line(summary.get("routing") or {})),
        ("prefix cache hits", _prefix_cache_line(summary.get("prefix_cache") or {})),
    ]
    evaluated = summary.get("eval")
    if evaluated:
        for which in ("first", "last"):
            e = evaluated[which]
            rows.append((f"eval, {which} (step {e['step']})",
                         f"pass@1 {_fmt(e['pass@1'], '.3f')}  mean@{e['k']} {_fmt(e['mean@k'], '.3f')}"))  # fmt: skip
    for rid, n in summary["requests"].items():
        loaded = len(summary["versions_loaded"][rid])
        rows.append((f"replica {rid}", f"{n} requests, {loaded} versions loaded"))
    restarted = {rid: n for rid, n in summary.get("replica_restarts", {}).items() if n}
    if restarted:
        rows.append(("replica restarts", ", ".join(f"{rid} {n}" for rid, n in restarted.items())))
    for actor in ("trainer", "proxy"):  # Ray restarted the actor after its process died
        if summary.get(f"{actor}_restarts"):
            rows.append((f"{actor} restarts", summary[f"{actor}_restarts"]))
    for fault in summary.get("faults", []):
        again = "training" if fault["who"] == "trainer" else "serving"
        back = (
            f"{again} again after {fault['recovered_s']:.0f} s"
            if fault["recovered_s"] is not None
            else "never back"
        )
        rows.append((f"fault, {fault['who']}", f"{fault['what']}; {back}"))
    for event in summary.get("scale_events", []):
        rows.append(("pool scaled", f"{event['from']} -> {event['to']}: {event['reason']}"))
    ranks = summary.get("trainer_ranks") or []
    for actor, where in summary.get("placement", {}).items():
        if actor == "trainer" and ranks:
            continue  # each rank's row below says where it runs
        earlier = summary.get("placement_history", {}).get(actor.removeprefix("generator "), [])[:-1]
        before = f" (before: {', '.join(s['address'] for s in earlier)})" if earlier else ""
        rows.append((f"{actor} on", where["address"] + before))
    for rank, where in enumerate(ranks):
        rows.append((f"trainer rank {rank}/{len(ranks)}", f"{where['address']} (pid {where['pid']})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
