"""The run's task as the trainer sees it: its prompt dataset and its reward functions."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from rl_cluster.config import RunConfig
from rl_cluster.tiny import make_prompts


def import_function(path: str):
    """`package.module:function` -> the function (reward functions must be importable, not closures)."""
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"reward {path!r} must look like package.module:function")
    return getattr(importlib.import_module(module), name)


def load_prompts(config: RunConfig):
    from datasets import Dataset

    task = config.task
    if task.prompts == "dataset":  # written into the bucket by `python -m rl_cluster.data prepare`
        from rl_cluster.data import load_prepared

        return load_prepared(config, "train")
    if task.prompts == "jsonl":
        rows = []
        for number, line in enumerate(Path(task.jsonl_path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{task.jsonl_path} line {number} is not JSON ({e.msg}): {line[:80]!r}"
                ) from None
    else:
        rows = make_prompts(task.num_prompts, seed=config.trainer.seed)
    return Dataset.from_list(rows)
