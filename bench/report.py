"""BENCHMARKS.md and its plots, from the benchmarks' result dicts."""

from __future__ import annotations

import os
from pathlib import Path

from bench import trainer_ranks
from bench.markdown import failure_section, num, pct, provenance, span, table
from bench.plots import draw_all
from bench.report_scale import (
    broadcast_section,
    capacity_section,
    pool_step_section,
    routing_at_scale_section,
)


def routing_section(r: dict) -> str:
    load = r["load"]
    rows = [
        [
            x["router"],
            pct(x["affinity"]),
            pct(x["cache_hit_rate"]),
            pct(x["share_on_busier_replica"]),
            num(x["throughput"], ".1f"),
            span(x["throughput_range"]),
            num(x["throughput_vs_ours"], ".2f") + "x",
        ]
        for x in r["rows"]
    ]
    header = ["router", "affinity", "replica prefix-cache hit rate", "requests on busier replica",
              "completions/s", "range over reps", "throughput vs ours (prefix)"]  # fmt: skip
    return "\n\n".join(
        [
            "## 1. Routing: prefix-aware vs round-robin vs least-loaded vs vllm-router",
            f"Two vLLM replicas, {load['groups']} GRPO groups of G={load['group_size']} identical token-id prompts "
            f"({load['prompt_tokens']} tokens: a shared system prompt and a distinct user part, chat template "
            f"applied), {load['groups_in_flight']} groups in flight, {load['max_tokens']} completion tokens each "
            "(ignore_eos). Every router is sent the base model name (vllm-router knows nothing of our adapter "
            "versions). *Affinity*: share of a group's requests on the group's majority replica, seen by a "
            "pass-through tap in front of each replica. *Hit rate*: the replicas' own "
            "`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the run (caches emptied "
            "before each run; vLLM's CPU block is 128 tokens, so a perfect group scores at most "
            "(G-1)/G x 128/prompt tokens). Medians over repetitions; the ratio is the median of per-repetition "
            "ratios against our prefix policy in the same repetition.",
            table(header, rows),
            "How to read the throughput column on this machine: one replica out-runs two here (see 4. "
            "Scaling), so a router that piles every request onto one replica looks fast on 2 cores and would "
            "halve capacity on a real cluster. *Requests on busier replica* shows which routers did that. "
            "The cache columns are the portable result: they say whether a group's G samples met their shared "
            "prompt prefix in one replica's KV cache. The gap between the policies is small here because "
            "only one 128-token block of each prompt can be cached: a group split over two replicas misses "
            f"once per replica, (G-2)/G x 128/{load['prompt_tokens']} = "
            f"{pct((load['group_size'] - 2) / load['group_size'] * 128 / load['prompt_tokens'])}, against "
            f"{pct((load['group_size'] - 1) / load['group_size'] * 128 / load['prompt_tokens'])} for a group kept "
            "together. It grows with longer prompts (more blocks per prompt) and more replicas.",
            *[f"> {note}" for note in r["notes"]],
        ]
    )


def overhead_section(r: dict) -> str:
    load = r["load"]
    rows = [
        [
            x["path"],
            x["load"],
            num(x["throughput"], ".1f"),
            num(x["throughput_vs_direct"], ".2f") + "x",
            num(x["throughput_vs_floor"], ".2f") + "x",
            num(x["p50_ms"], ".1f"),
            num(x["added_p50_ms"], "+.1f"),
            num(x["p50_vs_floor_ms"], "+.2f"),
            num(x["added_p99_ms"], "+.1f"),
        ]
        for x in r["rows"]
    ]
    header = ["path", "load", "requests/s", "vs direct", "vs pass-through", "p50 ms", "added p50 ms",
              "p50 vs pass-through ms", "added p99 ms"]  # fmt: skip
    tokens = ", ".join(f"{name}: {n} tokens" for name, n in load["prompt_tokens"].items())
    verdicts = [_overhead_verdict(name, g) for name, g in r.get("goal", {}).items()]
    return "\n\n".join(
        [
            "## 2. Proxy overhead",
            f"One vLLM replica; per round and path {load['requests']} requests ({tokens}) of "
            f"{load['max_tokens']} completion tokens, {load['concurrency']} in flight, in {load['rounds']} "
            "rounds that alternate the paths (so that other users' load on this shared machine hits all paths "
            "alike). *aiohttp pass-through*: a do-nothing forwarder in its own process "
            "(`bench/proxy_process.py --passthrough`, a dozen lines), the floor any Python front pays for "
            "the extra hop here. Both it and our proxy run as the ProxyActor does in a run: on uvloop (Ray "
            "runs async actors on it), with the start-up heap frozen (`rl_cluster/proxy/heap.py`). Ratios and added latencies are medians over rounds of the path against "
            "direct (or the pass-through) in the same round; differences of a few tenths of a millisecond "
            "are within this machine's noise (a negative value means just that).",
            table(header, rows),
            *verdicts,
            "How far to trust a verdict: the middle half of the rounds spans about a quarter of throughput "
            "and several milliseconds of p50 on every path (the replica, four processes and other users' "
            "work share two cores), so a median over this many rounds is good to a few percent, coarser "
            "than the goal's 0.02x and 0.5 ms. The proxy's own cost per request shows in section 6, which "
            "measures routers alone on stub upstreams.",
            *[f"> {note}" for note in r["notes"]],
        ]
    )


def _overhead_verdict(name: str, g: dict) -> str:
    """One path's verdict against section 2's goals, each ratio with the spread of its middle rounds."""
    router = g["throughput_vs_router"]

    def spread(key: str, spec: str = ".2f", unit: str = "x") -> str:
        low, high = g.get(f"{key}_middle") or (None, None)
        return (
            ""
            if low is None
            else f" (middle half of the rounds: {num(low, spec)} to {num(high, spec)}{unit})"
        )

    return (
        f"- {name}: our proxy runs at {num(g['throughput_vs_floor'])}x the pass-through's throughput"
        f"{spread('throughput_vs_floor')} (goal: at least 0.98x) with {num(g['p50_vs_floor_ms'], '+.2f')} ms "
        f"of p50 over it{spread('p50_vs_floor_ms', '+.2f', ' ms')} (goal: at most 0.5 ms): "
        f"{'met' if g['within_floor'] else 'not met'}"
        + (
            "."
            if router is None
            else f"; {num(router)}x vllm-router's throughput{spread('throughput_vs_router')} (goal: at "
            "least 1.00x)."
        )
    )


def handoff_section(r: dict) -> str:
    def cell(row, key):
        s = row.get(key)
        return f"{num(s['p50_ms'], '.0f')} / {num(s['p95_ms'], '.0f')}" if s else "-"

    rows = [
        [x["path"], cell(x, "publish_s"), cell(x, "verify_s"), cell(x, "load_s"), cell(x, "routable_s")]
        for x in r["rows"]
    ]
    header = ["path", "publish (p50 / p95 ms)", "fetch_verified alone", "load on every replica",
              "publish -> routable"]  # fmt: skip
    tiny, qwen = r["bytes"]["tiny"], r["bytes"]["qwen25_1p5b"]
    sizes = table(
        ["model", "full weights", "rank-1 LoRA (q,k,v,o,gate,up,down)", "LoRA / full"],
        [
            [
                f"tiny (this benchmark, {tiny['dtype']}, measured files)",
                f"{tiny['full_bytes'] / 1e6:.2f} MB",
                f"{tiny['lora_bytes'] / 1e3:.1f} kB (fp32, safetensors)",
                pct(tiny["lora_bytes"] / tiny["full_bytes"]),
            ],
            [
                "Qwen2.5-1.5B (computed from its config)",
                f"{qwen['full_bytes_bf16'] / 1e9:.2f} GB (bf16, {qwen['full_params'] / 1e9:.2f} B params)",
                f"{qwen['lora_bytes_fp32'] / 1e6:.2f} MB fp32 / {qwen['lora_bytes_bf16'] / 1e6:.2f} MB bf16 "
                f"({qwen['lora_params'] / 1e6:.2f} M params)",
                pct(qwen["lora_bytes_fp32"] / qwen["full_bytes_bf16"]) + " (fp32 LoRA vs bf16 model)",
            ],
        ],
    )
    return "\n\n".join(
        [
            "## 3. Handoff: publish -> routable on every replica",
            f"{r['versions']} versions per path. *publish*: `Bucket.publish_adapter` (files, then manifest). "
            "*fetch_verified alone*: the generator's verify step timed by itself (it copies, or an s3 bucket downloads, into "
            "a fresh cache). *load on every replica*: POST /v1/load_lora_adapter to the proxy, which has each "
            "replica fetch + verify into its own cache and load into vLLM, all-or-nothing; it answers once "
            "every replica has it. *publish -> routable* = publish + load. The direct row loads the same "
            "adapter straight into one vLLM server: vLLM's own cost. Ray's actor hop (GeneratorActor) is not "
            "in these numbers.",
            table(header, rows),
            "Adapter bytes against full-model bytes:",
            sizes,
            "Qwen2.5-1.5B: hidden 1536, 28 layers, intermediate 8960, 12 heads / 2 KV heads (head dim 128), "
            "vocab 151936, tied embeddings. A rank-1 LoRA adds r x (in + out) parameters per module.",
        ]
    )


def scaling_section(r: dict) -> str:
    load = r["load"]
    rows = [
        [
            str(x["generators"]),
            num(x["throughput"], ".1f"),
            span(x["throughput_range"]),
            num(x["speedup_vs_1"], ".2f") + "x",
        ]
        for x in r["rows"]
    ]
    return "\n\n".join(
        [
            "## 4. Scaling: rollout throughput with 1 and 2 generators",
            f"Through our proxy (prefix policy), {load['groups']} GRPO groups of 8, {load['groups_in_flight']} "
            f"in flight, {load['max_tokens']} completion tokens, the same two replicas (one or both registered "
            "with the proxy). Read this as a fact about this 2-core machine, not about the design: each engine is "
            "pinned to its own core, and everything else (both replicas' API-server and scheduler processes, "
            "the proxy, the load generator, and other users' work on this shared machine) runs on those same "
            "two cores. The likely reason (not measured separately) is that with one generator the second core "
            "is left to that Python work, while with two it is not, and the tiny model is so cheap that "
            "per-request Python work, not the model, sets the pace. On machines where each generator has its "
            "own cores or GPU, this is the number to re-measure.",
            table(["generators", "completions/s", "range over reps", "vs 1 generator"], rows),
        ]
    )


def async_section(r: dict) -> str:
    c, s = r["config"], r["speedup"]
    rows = [
        [
            x["mode"],
            num(x["steps_per_hour"], ".0f"),
            num(x["mean_step_s"], ".2f"),
            pct(x["trainer_idle"]),
            pct(x["generator_idle"]),
            pct(x["dropped_share"]),
            num(x["reward_at_equal_time"], ".3f"),
            num(x["reward_last_fifth"], ".3f"),
        ]
        for x in r["rows"]
    ]
    header = ["run", "steps/hour", "s/step", "trainer idle", "generator idle", "samples dropped stale",
              "reward at equal wall time", "reward, last fifth"]  # fmt: skip
    return "\n\n".join(
        [
            "## 5. Asynchronous vs synchronous GRPO",
            f"`jobs/configs/cpu_demo.toml` with trainer.max_steps={c['steps']} ({c['completions_per_step']} "
            f"completions per step in groups of {c['num_generations']}, {c['max_new_tokens']} new tokens, a sync "
            f"every {c['sync_every']} step, generator.max_loras=6), once in lockstep (trainer.mode=sync: a "
            "step's samples are generated only after the sync before it) and once asynchronously "
            f"(trainer.mode=async, max_staleness={c['max_staleness']}, groups admitted as the trainer consumes "
            "them), on the same two replicas; "
            f"{c['reps']} repetition(s). Step times are TRL's `perf/step_s` over steps 2..N (step 1 includes "
            "start-up). *Trainer idle*: sum of `perf/rollout_wait_s` / sum of step times. *Generator idle*: "
            "share of 0.25 s samples of the proxy's in-flight count (through the Ray proxy actor) with nothing "
            "in flight, averaged over replicas, from the first rollout request to the end. *Dropped*: "
            "samples discarded as too stale / (dropped + trained). *Reward at equal wall time*: mean reward "
            "of the last fifth of the steps each run had completed when the faster run finished.",
            table(header, rows),
            f"**Speedup of asynchronous over synchronous: {num(s['measured'])}x measured; ideal "
            f"{num(s['ideal'])}x; measured = {pct(s['share_of_ideal'])} of ideal.**",
            "How the ideal is derived: in the lockstep run the trainer cannot start a step before the "
            "step's rollouts exist, and they are generated only after the previous step's adapter is "
            "published, so a step costs g + t: g, the generation time per step, is what the trainer waits "
            f"for rollouts (mean `perf/rollout_wait_s` = {num(s['g_s'])} s); t, the trainer's own time per step "
            f"(step time minus that wait, adapter publication included) = {num(s['t_s'])} s. Fully overlapped, "
            "a step costs max(g, t), so the best an asynchronous trainer can do is (g + t) / max(g, t).",
            *_async_caveats(s["share_of_ideal"]),
        ]
    )


def _async_caveats(share_of_ideal: float) -> list[str]:
    """What a reader must know when the measured speedup is far from the ideal one, either way."""
    if share_of_ideal > 1.02:
        return [
            "> MEASURED ABOVE IDEAL: the lockstep baseline did work a synchronous trainer would not "
            "(its dropped share above should be 0); the comparison is not valid."
        ]
    if share_of_ideal < 0.8:
        return [
            "> Far below ideal, and why: the ideal assumes generation and training run on separate "
            "devices, as on a GPU cluster (a trainer GPU, generator GPUs). Here the trainer and both "
            "vLLM replicas share the same 2 CPU cores, so whatever overlaps runs slower: the "
            "asynchronous run's step time is the two workloads contending, not max(g, t). The "
            "lockstep run gives each phase the whole machine in turn, which is why it holds up."
        ]
    return []


def experience_section(r: dict) -> str:
    c = r["config"]
    rows = [[row["setting"], num(row["mean_step_s"], ".3f"), pct(row["trainer_idle"])] for row in r["rows"]]
    return "\n\n".join([
        "## 7. Experience store overhead",
        f"The same asynchronous run ({c['steps']} steps of {c['completions_per_step']} completions, groups of "
        f"{c['num_generations']}) with `experience.enabled` on and off, side by side, {c['reps']} repetitions on the "
        f"same replicas. Every pulled sample becomes a row on the training thread; Parquet shards of "
        f"{c['shard_groups']} groups are written and committed on a background thread.",
        table(["setting", "mean step (s)", "trainer idle"], rows),
        f"Step time with the store / without: **{num(r['step_time_ratio'], '.3f')}×** (paired, median). The store "
        f"wrote {num(r['bytes_per_step'] / 1024, '.1f')} KiB per step ({num(r['bytes_per_group'], '.0f')} bytes "
        f"per group, zstd Parquet); rows lost to a full write queue: {r['lost_rows']}."
        + (" Repetitions: " + ", ".join(f"{x:.3f}×" for x in r["step_time_ratios"]) + "."
           if "step_time_ratios" in r else "")
        + (" Below 1 is the shared machine's noise between repetitions, not a gain: the store's cost is "
           "smaller than that noise." if r["step_time_ratio"] < 1 else ""),
    ])  # fmt: skip


def correction_section(r: dict) -> str:
    c = r["config"]

    def reward(x):
        return f"{num(x['reward_last_fifth_mean'], '.3f')} ({num(x['reward_last_fifth_min'], '.3f')} to " \
               f"{num(x['reward_last_fifth_max'], '.3f')})"  # fmt: skip

    def checks(x):
        k = x["checks"]
        return f"{k['match']} match, {k['too_close']} too close, {k['mismatch']} mismatch"

    rows = [
        [x["method"], num(x["reward_first_fifth_mean"], ".3f"), reward(x), num(x["ratio_mean"], ".4f"),
         num(x["ratio_max"], ".2f"), pct(x["share_corrected"]), num(x["mean_staleness"], ".2f"), checks(x)]
        for x in r["rows"]
    ]  # fmt: skip
    header = ["correction", "reward, first fifth", "reward, last fifth (min to max)", "pi_train/pi_vllm mean",
              "max", "tokens corrected", "mean staleness", "served-vs-trained checks"]  # fmt: skip
    return "\n\n".join([
        "## 11. Off-policy correction in bf16",
        f"`jobs/configs/cpu_demo.toml` in bfloat16 (trainer and two bf16 replicas), trainer.max_staleness="
        f"{c['max_staleness']}, {c['steps']} steps, once per method and seed for {c['seeds']} seeds (the methods "
        "of a seed back to back, their order rotating with the seed). `none`: TRL's clipped loss against "
        "vLLM's logprobs; `tis`: truncated importance sampling (cap trainer.correction_cap = 2); `icepop`: "
        "TRL's loss with tokens outside trainer.correction_band = [0.5, 5] masked. Rewards are at equal steps "
        "(the mean over seeds, and the lowest and highest seed). pi_train/pi_vllm is per token, over every "
        "step; *tokens corrected*: truncated (tis) or masked (icepop).",
        table(header, rows),
        _correction_verdict(r["rows"]),
    ])  # fmt: skip


def _correction_verdict(rows: list[dict]) -> str:
    best = max(rows, key=lambda x: x["reward_last_fifth_mean"] or 0.0)
    overlap = all(
        (x["reward_last_fifth_max"] or 0.0) >= (best["reward_last_fifth_min"] or 0.0)
        for x in rows
        if x is not best
    )
    return (
        f"**Highest mean reward at equal steps: `{best['method']}` ({num(best['reward_last_fifth_mean'], '.3f')}).** "
        + (
            "The seeds' spreads overlap: at this scale reward does not tell the methods apart. "
            if overlap
            else ""
        )
        + 'The default, `trainer.correction = "icepop"`, was picked from this table: the best mean reward, and '
        "TRL's loss left as it is on every token inside the band; the recipes say so in their configs."
    )


def write(out: Path, plots_dir: Path, results: dict, info: dict, command: str, quick: bool) -> None:
    """Write the markdown (and the plots beside it, linked relatively)."""
    plots = draw_all(results, plots_dir)
    sections = {
        "routing": (routing_section, "1. Routing"),
        "overhead": (overhead_section, "2. Proxy overhead"),
        "handoff": (handoff_section, "3. Handoff"),
        "scaling": (scaling_section, "4. Scaling"),
        "async_vs_sync": (async_section, "5. Asynchronous vs synchronous GRPO"),
        "capacity": (capacity_section, "6. Proxy capacity"),
        "experience": (experience_section, "7. Experience store overhead"),
        "broadcast": (broadcast_section, "8. Broadcast at scale"),
        "routing_at_scale": (routing_at_scale_section, "9. Routing at scale"),
        "pool_step": (pool_step_section, "10. The pool under a demand step"),
        "correction": (correction_section, "11. Off-policy correction in bf16"),
        "trainer_ranks": (trainer_ranks.section, "12. Trainer ranks"),
    }
    parts = [
        "# Benchmarks",
        "Generated by `make bench` (`python -m bench`); do not edit by hand. Every table's numbers come from "
        "one run, named under it (machine, date, command), with real vLLM CPU servers on the locally made tiny model, "
        "our proxy, vllm-router, moto's S3 server on loopback, Ray and TRL. Speed claims are ratios of runs "
        "made side by side in that one run on the same replicas (medians over repetitions whose order "
        "rotates): the machine is shared with other work, so absolute numbers move between runs."
        + (" **Quick mode: tiny loads, one repetition; numbers are smoke-test grade.**" if quick else ""),
        "No GPU was available to this run: GPU trainer measurements (step time, MFU, NCCL-free handoff at "
        "real model sizes) are out of scope here; the adapter-size table below computes the 1.5B case.",
    ]
    for key, (render, title) in sections.items():
        value = results.get(key)
        if value is None:
            continue
        if "error" in value:
            parts.append(failure_section(title, value["error"]))
            continue
        try:
            parts.append(render(value))
        except KeyError as e:  # results merged from an older run lack what this report shows now
            parts.append(failure_section(title, f"results of an older run lack {e}: rerun this section"))
            continue
        if key in plots:
            parts.append(f"![{title}]({os.path.relpath(plots[key], out.parent)})")
        # A section merged in from another run (python -m bench --only ... --merge) names its own run.
        parts.append(provenance(value.get("machine", info), value.get("command", command)))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(parts) + "\n")
