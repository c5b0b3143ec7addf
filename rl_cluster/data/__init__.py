"""A run's dataset (`task.prompts = "dataset"`): loaded with `datasets.load_dataset`, prepared once into the
bucket, read from there by the run.

Why a prepare step: on a cluster the trainer's node should not download from the hub mid-run, and every
node must see the same rows. `python -m rl_cluster.data prepare --config FILE [overrides]` loads the
recipe's `task.split` and `task.eval_split`, maps columns, turns text problems into one-turn chat prompts,
extracts MATH's boxed answer from a solution (`task.answer_from_solution`), drops what cannot be used
(with a count), and writes

    <bucket>/datasets/<key>/train.parquet, eval.parquet, prepared.json (written last: the commit)

`<key>` is the dataset's name plus a hash of everything that shapes the rows (the task's dataset fields,
model.path / revision, whose tokenizer measures the prompts, and the prompt token limit). The run computes
the same key from its own config, so prepare and train agree without an extra setting, and a run whose
config changed any of those finds no prepared data instead of reading stale rows: a new run prepares its
own before it starts (`ensure_prepared`), a resumed one stops and says how to make it.

A prompt longer than `model.max_model_len - trainer.max_new_tokens` tokens (by the tokenizer's own chat
template) is dropped at prepare time and counted: vLLM would refuse it, and it must never be sent.
"""

from __future__ import annotations

import datetime as _dt
import glob
import hashlib
import io
import json
import os
import re
from typing import Any

from rl_cluster.config import RunConfig, TaskConfig
from rl_cluster.core.math_grading import last_boxed

PREPARED_ROOT = "datasets"  # <bucket>/datasets/<key>/: beside the run directories, shared by runs
MARKER = "prepared.json"
# What `python -m rl_cluster.data tiny-math --out DIR` writes (rl_cluster.data.tiny_math).
_FILE_BUILDERS = {"parquet", "json", "csv", "text", "arrow"}  # `load_dataset` names that read data_files
_TINY_MATH_FILES = {f"{split}.{ext}" for split in ("train", "test") for ext in ("parquet", "jsonl")}
# The task fields that shape prepared rows (rewards, num_prompts, jsonl_path do not).
_SHAPING_FIELDS = {
    "dataset",
    "dataset_config",
    "dataset_revision",
    "data_files",
    "split",
    "eval_split",
    "columns",
    "answer_from_solution",
    "system_prompt",
    "prompt_template",
}


def prompt_token_limit(config: RunConfig) -> int:
    """Most prompt tokens a row may have: the context left after the longest completion."""
    return config.model.max_model_len - config.trainer.max_new_tokens


def prepared_key(config: RunConfig) -> str:
    """The directory name under `<bucket>/datasets/` of this config's prepared data."""
    task = config.task
    shaping = {
        "task": task.model_dump(include=_SHAPING_FIELDS),
        "model": [config.model.path, config.model.revision],
        "prompt_token_limit": prompt_token_limit(config),
    }
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:10]
    name = "-".join(p for p in (task.dataset, task.dataset_config) if p)
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name).strip('-.') or 'dataset'}-{digest}"


def load_split(task: TaskConfig, split: str):
    """One split of the configured dataset, as `datasets.load_dataset` gives it."""
    from datasets import load_dataset

    return load_dataset(
        task.dataset,
        name=task.dataset_config,
        data_files=task.data_files or None,
        revision=task.dataset_revision,
        split=split,
    )


def make_prompt(prompt: Any, task: TaskConfig) -> list[dict]:
    """A conversational prompt: message lists as they are; text into the template, after the system prompt.

    >>> make_prompt("What is $1+1$?", TaskConfig(system_prompt="Box it.", prompt_template="{prompt} Think."))
    [{'role': 'system', 'content': 'Box it.'}, {'role': 'user', 'content': 'What is $1+1$? Think.'}]
    """
    if isinstance(prompt, list):
        return prompt
    if not isinstance(prompt, str):
        raise ValueError(
            f"a prompt must be text or a list of messages, not {type(prompt).__name__}: {prompt!r:.80}"
        )
    system = [{"role": "system", "content": task.system_prompt}] if task.system_prompt is not None else []
    return [*system, {"role": "user", "content": task.prompt_template.replace("{prompt}", prompt)}]


def to_rows(records: list[dict], task: TaskConfig, where: str) -> tuple[list[dict], int]:
    """Mapped, prompt-ready rows, and how many were dropped for having no boxed answer. `where` names the
    source in errors."""
    available = sorted(records[0]) if records else []
    missing = [c for c in task.columns if c not in available]
    if missing:
        raise ValueError(f"task.columns names {missing}, which {where} lacks; its columns are {available}")
    rows, no_answer = [], 0
    for record in records:
        row = {task.columns[c]: record[c] for c in task.columns} if task.columns else dict(record)
        if "prompt" not in row:
            raise ValueError(
                f"{where} has no `prompt` column; map one with task.columns (columns: {available})"
            )
        if task.answer_from_solution:
            if "answer" not in row:
                raise ValueError(
                    f"task.answer_from_solution: {where} has no `answer` column (map the solution to it)"
                )
            row["answer"] = last_boxed(str(row["answer"] or ""))
            if not row["answer"]:
                no_answer += 1
                continue
        row["prompt"] = make_prompt(row["prompt"], task)
        rows.append(row)
    return rows, no_answer


def drop_long(rows: list[dict], tokenizer, limit: int) -> tuple[list[dict], int]:
    """The rows whose chat-templated prompt (with the generation prompt) has at most `limit` tokens, and
    how many were longer."""
    kept = [
        row
        for row in rows
        if len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False)) <= limit
    ]  # fmt: skip
    return kept, len(rows) - len(kept)


def load_tokenizer(config: RunConfig):
    """The run's tokenizer. A hub id is fetched by AutoTokenizer itself (its few files, through the same
    Hugging Face cache and variables as resolve_model), not a whole model download."""
    from transformers import AutoTokenizer

    from rl_cluster.models import TINY_MODELS, resolve_model

    path = config.model.path
    local = path in TINY_MODELS or os.path.isdir(path)
    source = resolve_model(path, config.model.revision) if local else path
    return AutoTokenizer.from_pretrained(source, revision=config.model.revision)


def missing_data_files(task: TaskConfig) -> list[str]:
    """The local `task.data_files` (paths or glob patterns) of a file builder that name no file. Remote
    ones (`hf://`, `s3://`, ...), and those of a hub dataset (paths inside its repository), are left to
    `datasets`."""
    if task.dataset not in _FILE_BUILDERS:
        return []
    paths = [p for files in task.data_files.values() for p in files if "://" not in p]
    return [p for p in paths if not (glob.glob(p) if glob.has_magic(p) else os.path.isfile(p))]


def _missing_files_message(missing: list[str]) -> str:
    where = f"task.data_files: {', '.join(missing)} not found (in {os.getcwd()})"
    if all(os.path.basename(p) in _TINY_MATH_FILES for p in missing):
        out = os.path.dirname(missing[0]) or "."
        return f"{where}; write the tiny MATH task first: python -m rl_cluster.data tiny-math --out {out}"
    return f"{where}; write the data before `prepare`"


def _bucket(config: RunConfig):
    from rl_cluster.bucket import Bucket

    return Bucket(config.bucket.uri, config.bucket.s3_endpoint_url)


def prepare(config: RunConfig, tokenizer=None, log=print) -> dict:
    """Load, shape and filter the train and eval splits, and write them into the bucket (module docstring).
    Returns what `prepared.json` says. `tokenizer`: the run's (default: loaded from model.path)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    task = config.task
    if task.prompts != "dataset":
        raise ValueError(f'prepare needs task.prompts = "dataset" (this config has {task.prompts!r})')
    missing = missing_data_files(task)
    if missing:  # before the tokenizer, which may first build a tiny model (a minute on a CPU)
        raise FileNotFoundError(_missing_files_message(missing))
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config)
    limit = prompt_token_limit(config)
    bucket, key = _bucket(config), prepared_key(config)
    splits = {"train": task.split, **({"eval": task.eval_split} if task.eval_split else {})}
    report: dict[str, Any] = {}
    for name, source_split in splits.items():
        where = f"{task.dataset}[{source_split}]"
        records = load_split(task, source_split).to_list()
        rows, no_answer = to_rows(records, task, where)
        rows, too_long = drop_long(rows, tokenizer, limit)
        if not rows:
            raise ValueError(
                f"{where}: no rows left of {len(records)} ({no_answer} without a boxed answer, {too_long} longer "
                f"than {limit} prompt tokens)"
            )
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buffer)
        uri = bucket.write_bytes(PREPARED_ROOT, f"{key}/{name}.parquet", buffer.getvalue())
        report[name] = {
            "source_split": source_split,
            "source_rows": len(records),
            "rows": len(rows),
            "dropped_no_answer": no_answer,
            "dropped_too_long": too_long,
        }
        log(
            f"{name}: {len(rows)} of {len(records)} rows of {where} -> {uri}; dropped {too_long} with prompts "
            f"longer than {limit} tokens (model.max_model_len - trainer.max_new_tokens)"
            + (f" and {no_answer} without a boxed answer" if task.answer_from_solution else "")
        )
    meta = {
        "key": key,
        "dataset": task.dataset,
        "dataset_config": task.dataset_config,
        "model": config.model.path,
        "prompt_token_limit": limit,
        "splits": report,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    bucket.write_text(PREPARED_ROOT, f"{key}/{MARKER}", json.dumps(meta, indent=1))  # last: the commit
    return meta


def prepared_meta(config: RunConfig) -> dict:
    """What `prepared.json` of this config's prepared data says; FileNotFoundError, saying what to run,
    when there is none. Cheap: a driver can call it before it starts anything."""
    bucket, key = _bucket(config), prepared_key(config)
    try:
        return json.loads(bucket.read_text(PREPARED_ROOT, f"{key}/{MARKER}"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no prepared data for this config at {bucket.uri}/{PREPARED_ROOT}/{key}: run `python -m "
            "rl_cluster.data prepare --config <this run's config> <its overrides>` first (the location follows "
            "the task's dataset fields, model.path, model.max_model_len and trainer.max_new_tokens)"
        ) from None


def ensure_prepared(config: RunConfig, log=print) -> dict:
    """This config's prepared data: what is there, else `prepare`d now (a RayJob has no earlier step to run
    `prepare` in; the key keeps a run from reading rows prepared for another config). Errors as
    `prepare`'s: FileNotFoundError for data files not there, ValueError for rows it cannot use."""
    try:
        return prepared_meta(config)
    except FileNotFoundError:
        log(f"no prepared data for this config at {config.bucket.uri}/{PREPARED_ROOT}/{prepared_key(config)}: "
            "preparing it now, as `python -m rl_cluster.data prepare` would")  # fmt: skip
    return prepare(config, log=log)


def load_prepared(config: RunConfig, split: str = "train"):
    """The prepared `train` (shuffled with trainer.seed: TRL reads a dataset in order) or `eval` split, as a
    `datasets.Dataset`, read through the bucket."""
    import datasets
    import pyarrow.parquet as pq

    meta = prepared_meta(config)
    if split not in meta["splits"]:
        raise ValueError(f"prepared data {meta['key']} has no {split!r} split (task.eval_split unset?): "
                         f"{sorted(meta['splits'])}")  # fmt: skip
    data = _bucket(config).read_bytes(PREPARED_ROOT, f"{meta['key']}/{split}.parquet")
    dataset = datasets.Dataset(pq.read_table(io.BytesIO(data)))
    return dataset.shuffle(seed=config.trainer.seed) if split == "train" else dataset
