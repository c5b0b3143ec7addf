"""Held-out eval, the pure part: which problems, how scores become pass@1 and mean@k, what a run records.

pass@1 is the mean reward of one greedy (temperature 0) completion per problem; mean@k the mean reward of k
sampled completions per problem, averaged over problems. With a 0/1 grader (math_reward) pass@1 is the
share of problems answered right, and mean@k an estimate of the policy's sampled accuracy that does not
hinge on one draw. A problem whose requests failed is left out of both (and counted), so a transient
proxy error lowers the sample, not the score.

An eval is one record `{"kind": "eval", "step", "pass@1", "mean@k", "k", ...}`: `metrics.jsonl` holds them
beside the step records (each after the step record of its step; step 0 before all of them), told apart
by `kind` (step records have none). No torch, Ray, vLLM or HTTP here: rl_cluster.trainer.evaluation
generates and grades.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

EVAL_KIND = "eval"


def eval_indices(n_rows: int, max_problems: int | None, seed: int) -> list[int]:
    """The rows of the eval split used: all of them, or a fixed sample of `max_problems` (in order), the
    same at every eval of a run.

    >>> eval_indices(5, None, 0), eval_indices(5, 9, 0), len(eval_indices(100, 10, 0))
    ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], 10)
    """
    if max_problems is None or max_problems >= n_rows:
        return list(range(n_rows))
    return sorted(random.Random(seed).sample(range(n_rows), max_problems))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def aggregate(greedy_P: Sequence[float | None], sampled_PK: Sequence[Sequence[float] | None], k: int) -> dict:
    """pass@1 and mean@k over problems. `greedy_P[i]`: the reward of problem i's greedy completion;
    `sampled_PK[i]`: the rewards of its k samples; None for a problem whose requests failed. A reward of
    None or NaN (the grader could not score it) counts as 0: an answer nobody can grade is not right.

    >>> aggregate([1.0, 0.0, None], [[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0], None], k=4)
    {'pass@1': 0.5, 'mean@k': 0.5, 'k': 4, 'problems': 2, 'failed': 1}
    """
    if len(greedy_P) != len(sampled_PK):
        raise ValueError(f"{len(greedy_P)} greedy scores for {len(sampled_PK)} problems")
    done = [
        i
        for i, (g, s) in enumerate(zip(greedy_P, sampled_PK, strict=True))
        if g is not None and s is not None
    ]
    for i in done:
        if len(sampled_PK[i]) != k:
            raise ValueError(f"problem {i} has {len(sampled_PK[i])} sampled rewards, not k={k}")

    def score(r: float | None) -> float:
        return 0.0 if r is None or math.isnan(r) else float(r)

    return {
        "pass@1": _mean([score(greedy_P[i]) for i in done]),
        "mean@k": _mean([_mean([score(r) for r in sampled_PK[i]]) for i in done]),
        "k": k,
        "problems": len(done),
        "failed": len(greedy_P) - len(done),
    }


def eval_record(step: int, adapter: str, version: int, scores: dict, eval_s: float) -> dict:
    """One eval's line of metrics.jsonl: `scores` from `aggregate`, under the adapter version it served."""
    return {"kind": EVAL_KIND, "step": step, **scores, "adapter": adapter, "version": version,
            "eval_s": round(eval_s, 2)}  # fmt: skip


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def eval_line(record: dict) -> str:
    """The progress line of one eval: `eval step 20  pass@1 0.640  mean@4 0.512  (v21, 100 problems, 8.1s)`."""
    failed = f", {record['failed']} failed" if record["failed"] else ""
    return (
        f"eval step {record['step']:>4}  pass@1 {_fmt(record['pass@1'])}  mean@{record['k']} "
        f"{_fmt(record['mean@k'])}  (v{record['version']}, {record['problems']} problems{failed}, "
        f"{record['eval_s']:.1f}s)"
    )


def is_eval(record: dict) -> bool:
    return record.get("kind") == EVAL_KIND


def with_evals(history: list[dict], evals: list[dict]) -> list[dict]:
    """metrics.jsonl's records in order: by step, each eval after the step record of the same step."""
    return sorted([*history, *evals], key=lambda r: (r["step"], is_eval(r)))


def split_records(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl's records -> (step records, eval records)."""
    return [r for r in records if not is_eval(r)], [r for r in records if is_eval(r)]


def eval_summary(evals: list[dict]) -> dict | None:
    """summary.json's `eval`: the first and the last eval, and pass@1 / mean@k per eval step; None when the
    run made none."""
    if not evals:
        return None
    ordered = sorted(evals, key=lambda r: r["step"])
    return {
        "first": ordered[0],
        "last": ordered[-1],
        "steps": [{"step": r["step"], "pass@1": r["pass@1"], "mean@k": r["mean@k"]} for r in ordered],
    }
