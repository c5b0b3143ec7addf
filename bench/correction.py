"""Section 11: the off-policy correction in bf16, `none` vs `tis` vs `icepop`, side by side.

The toy task (jobs/configs/cpu_demo.toml) in bfloat16 on two bf16 replicas of its own, at max_staleness 4,
where both the kernels' rounding and staleness put distance between the policy that sampled a token and
the one trained. Each method trains once per seed, the methods of one seed back to back (the order
rotating between seeds) so that a slow phase of this shared machine hits them alike. Compared at equal
steps: reward (mean and spread over seeds), pi_train / pi_vllm per token, the share of tokens corrected,
and the served-vs-trained checks' verdicts (bf16 rounding must never fail them).
"""

from __future__ import annotations

import statistics
import time

from bench.async_vs_sync import DEMO_CONFIG, train_side_by_side
from bench.common import vllm_servers
from rl_cluster.config import load_config
from rl_cluster.core.summary import correction_summary, fifths, finite_mean, served_check_summary

METHODS = ("none", "tis", "icepop")
MAX_STALENESS = 4


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    """The methods x plan.correction_seeds runs, on bf16 replicas started here (the benchmark's own
    `servers` serve fp32)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    common = [f"trainer.max_steps={plan.correction_steps}", f"bucket.uri={log_dir / 'bucket'}",
              "model.dtype=bfloat16", f"trainer.max_staleness={MAX_STALENESS}", "generator.max_loras=6",
              "logging.wandb=off", "experience.enabled=false", "check.every_syncs=5"]  # fmt: skip
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    async with vllm_servers(model_dir, 2, log_dir, dtype="bfloat16") as bf16:
        for seed in range(plan.correction_seeds):
            # One seed's three runs, the order rotating with the seed (train_side_by_side rotates by rep).
            turn = seed % len(METHODS)
            configs = {
                m: load_config(
                    DEMO_CONFIG,
                    [
                        *common,
                        f"trainer.correction={m}",
                        f"trainer.seed={seed}",
                        f"run_name=bench-corr-{m}-{seed}-{stamp}",
                    ],
                )  # fmt: skip
                for m in METHODS[turn:] + METHODS[:turn]
            }

            def record(method: str, config, result: dict, seed: int = seed) -> None:
                runs[method].append(run_record(method, seed, result))
                print(f"  {method} seed {seed}: reward, last fifth {runs[method][-1]['reward_last_fifth']:.3f}",
                      flush=True)  # fmt: skip

            await train_side_by_side(bf16, model_dir, log_dir, configs, 1, record)
    return summarize(runs, plan)


def run_record(method: str, seed: int, result: dict) -> dict:
    history = result["history"]
    first, last = fifths([r["reward"] for r in history])
    return {
        "method": method,
        "seed": seed,
        "steps": len(history),
        "reward_first_fifth": first,
        "reward_last_fifth": last,
        "rewards": [r["reward"] for r in history],
        "mean_staleness": statistics.fmean([r["staleness"] or 0.0 for r in history]) if history else None,
        **{k: v for k, v in correction_summary(method, history).items() if k != "method"},
        "checks": served_check_summary(result["syncs"]),
    }


def summarize(runs: dict[str, list[dict]], plan) -> dict:
    rows = []
    for method, rs in runs.items():
        last = [r["reward_last_fifth"] for r in rs if r["reward_last_fifth"] is not None]
        rows.append({
            "method": method,
            "seeds": len(rs),
            "reward_last_fifth_mean": statistics.fmean(last) if last else None,
            "reward_last_fifth_min": min(last, default=None),
            "reward_last_fifth_max": max(last, default=None),
            "reward_first_fifth_mean": statistics.fmean([r["reward_first_fifth"] for r in rs]) if rs else None,
            "ratio_mean": finite_mean(r["ratio_mean"] for r in rs),
            "ratio_max": max((r["ratio_max"] for r in rs if r["ratio_max"] is not None), default=None),
            "share_corrected": statistics.fmean([r["share_corrected"] or 0.0 for r in rs]) if rs else None,
            "mean_staleness": statistics.fmean([r["mean_staleness"] or 0.0 for r in rs]) if rs else None,
            "checks": {k: sum(r["checks"][k] for r in rs) for k in ("checks", "match", "too_close", "mismatch")},
            "floor_max": max((r["checks"]["floor_max"] for r in rs if r["checks"]["floor_max"]), default=None),
        })  # fmt: skip
    return {
        "config": {
            "steps": plan.correction_steps,
            "seeds": plan.correction_seeds,
            "max_staleness": MAX_STALENESS,
        },
        "rows": rows,
        "runs": [r for rs in runs.values() for r in rs],
    }
