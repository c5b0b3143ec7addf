"""A math task in the MATH format, made locally: the CPU stand-in for MATH that the tiny model can learn.

Rows look like MATH's (`problem`, `solution` with the answer in `\\boxed{}`, `level`, `type`), so a run
on them goes through everything the MATH recipes use: `task.prompts = "dataset"` with the parquet or json
builder, `answer_from_solution`, `prepare`, and `math_reward`. The problems are single-digit sums (or
differences) short enough for the tiny model's character-level tokenizer and 256-token context:
`What is $3+4$?` -> `$3+4=\\boxed{7}$.`

The eval split is every distinct problem once, in order; the train split draws from the same problems
with replacement: the tiny model cannot generalise to unseen sums, so "held out" here means held-out
samples, and eval pass@1 measures how sharply the policy answers.

    python -m rl_cluster.data tiny-math --out DIR     # writes DIR/{train,test}.{parquet,jsonl}
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def _row(a: int, b: int, op: str) -> dict:
    result = a + b if op == "+" else a - b
    return {
        "problem": f"What is ${a}{op}{b}$?",
        "solution": f"${a}{op}{b}={result}$, so the answer is $\\boxed{{{result}}}$.",
        "level": "Level 1",
        "type": "Arithmetic",
    }


def all_problems(operations: str = "+") -> list[dict]:
    """Every distinct problem once: a+b for single digits a, b (and a-b with a >= b for `-`)."""
    return [
        _row(a, b, op)
        for op in operations
        for a in range(10)
        for b in range(10)
        if op == "+" or (op == "-" and a >= b)
    ]


def make_rows(n: int, seed: int, operations: str = "+") -> list[dict]:
    """`n` rows drawn with replacement from `all_problems(operations)`."""
    if not operations or set(operations) - {"+", "-"}:
        raise ValueError(f"operations={operations!r}: use '+', '-' or '+-'")
    problems = all_problems(operations)
    rng = random.Random(seed)
    return [rng.choice(problems) for _ in range(n)]


def write_task(out_dir: str | Path, train_rows: int = 2000, seed: int = 0, operations: str = "+") -> dict:
    """Write `train` and `test` splits as parquet and jsonl under `out_dir`; returns {split: {format: path}}.
    Use them as `task.dataset = "parquet"`, `task.data_files = { train = [...], test = [...] }`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = {"train": make_rows(train_rows, seed, operations), "test": all_problems(operations)}
    written: dict[str, dict[str, Path]] = {}
    for split, rows in splits.items():
        parquet, jsonl = out / f"{split}.parquet", out / f"{split}.jsonl"
        pq.write_table(pa.Table.from_pylist(rows), parquet)
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
        written[split] = {"parquet": parquet, "jsonl": jsonl}
    return written
