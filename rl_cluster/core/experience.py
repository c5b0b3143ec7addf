"""The experience store's rules: what a row says, how shards are named, what a shard's manifest says, and
the summaries made from rows. Pure (no IO, no numpy: plain Python), so every rule tests in milliseconds.

Every sample the trainer pulls from the rollout queue, trained or dropped as stale, becomes one row; rows
are written as Parquet shards `<bucket>/<run_name>/experience/shard-<seq:06d>-<segment>/rows.parquet`,
committed like adapter versions (files first, `manifest.json` last; a shard without its manifest does not
exist). `segment` names the trainer process that wrote the shard: the hex time it started, then random
hex, so a restarted trainer (whose `seq` and `group_id` start again at 0) never overwrites a shard, and
names sort oldest process first.

A row (one training sequence of TRL's `RolloutSample`; a multi-turn rollout that forked has several rows
with the same group_id):

    segment          str        trainer process that pulled it (see above)
    group_id         int        TRL's rollout group (one prompt, num_generations completions); unique per
                                segment, so a group is (segment, group_id)
    model_version    int        version N of the adapter the completion was sampled under
    adapter          str        its name, `<adapter_name>-v<N>` (the bucket's adapters/ directory)
    trainer_version  int        the trainer's policy version when it pulled the sample
    staleness        int        trainer_version - model_version
    trained          bool       False: dropped as stale (staleness > trainer.max_staleness), not trained
    prompt_ids       list[int]  tokens before the first trained one (the prompt)
    completion_ids   list[int]  the rest: prompt_ids + completion_ids is the sequence the trainer saw
    completion_mask  list[int]  per completion token, 1 = trained (0: context, e.g. a tool's answer)
    logprobs         list[float] per completion token, vLLM's sampled logprob of that token given the
                                tokens before it (0.0 where completion_mask is 0)
    reward           float      the summed reward (NaN when no reward function could score it)
    rewards          struct     per reward function, its reward: {"<func name>": float}
    advantage        float      the GRPO advantage the trainer used (or would have used)
    enqueued_at      float|None unix time the rollout loop queued it
    pulled_at        float      unix time the trainer pulled it
"""

from __future__ import annotations

import math
import re
import secrets
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from rl_cluster.core.manifest import (
    MANIFEST_FORMAT,
    adapter_dir_name,
    check_fields,
    check_file_entries,
    load_json,
)
from rl_cluster.core.summary import finite_mean
from rl_cluster.errors import AdapterRejected

EXPERIENCE = "experience"  # the manifest's `kind`
EXPERIENCE_DIR = "experience"  # under `<run>/`
SHARD_FILE = "rows.parquet"
# Column -> Arrow type, in file order; `rewards` is a struct of float64 whose fields are the run's reward
# functions. The writer maps these names to pyarrow types.
COLUMNS: dict[str, str] = {
    "segment": "string",
    "group_id": "int64",
    "model_version": "int64",
    "adapter": "string",
    "trainer_version": "int64",
    "staleness": "int64",
    "trained": "bool",
    "prompt_ids": "list<int32>",
    "completion_ids": "list<int32>",
    "completion_mask": "list<int8>",
    "logprobs": "list<float32>",
    "reward": "float64",
    "rewards": "struct<float64>",
    "advantage": "float64",
    "enqueued_at": "float64",
    "pulled_at": "float64",
}
_SEGMENT = re.compile(r"[0-9a-z]{1,32}")
_SHARD_NAME = re.compile(r"shard-([0-9]{6,})-([0-9a-z]{1,32})")
_SHARD_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (int,),
    "name": (str,),
    "seq": (int,),
    "segment": (str,),
    "rows": (int,),
    "groups": (int,),
    "created_at": (str,),
    "files": (dict,),
}


class Sample(Protocol):
    """What a row is made from: the fields of TRL's `RolloutSample` the store keeps."""

    input_ids: Sequence[int]  # prompt + completion tokens (numpy int64 from TRL)
    completion_mask: Sequence[int]  # 1 on trained tokens
    old_log_probs: Sequence[float]  # per token, its sampled logprob; 0.0 on context
    advantage: float
    model_version: int
    group_id: int
    metrics: Mapping[str, float]  # "reward", "rewards/<func>", ...
    enqueued_at: float | None


# -------------------------------------------------------------------- rows


def sample_row(
    sample: Sample,
    *,
    segment: str,
    adapter_name: str,
    trainer_version: int,
    trained: bool,
    pulled_at: float,
) -> dict[str, Any]:
    """The row of one sample (see the module docstring for the columns)."""
    ids, mask, logprobs = (
        _plain_list(a) for a in (sample.input_ids, sample.completion_mask, sample.old_log_probs)
    )
    if not len(ids) == len(mask) == len(logprobs):
        raise ValueError(
            f"group {sample.group_id}: input_ids, completion_mask and old_log_probs have lengths "
            f"{len(ids)}, {len(mask)}, {len(logprobs)}; they must be aligned"
        )
    start = next((i for i, m in enumerate(mask) if m), len(ids))
    metrics = sample.metrics
    return {
        "segment": segment,
        "group_id": int(sample.group_id),
        "model_version": int(sample.model_version),
        "adapter": adapter_dir_name(adapter_name, int(sample.model_version)),
        "trainer_version": int(trainer_version),
        "staleness": int(trainer_version) - int(sample.model_version),
        "trained": bool(trained),
        "prompt_ids": ids[:start],
        "completion_ids": ids[start:],
        "completion_mask": mask[start:],
        "logprobs": logprobs[start:],
        "reward": float(metrics.get("reward", math.nan)),
        "rewards": {
            k.removeprefix("rewards/"): float(v) for k, v in metrics.items() if k.startswith("rewards/")
        },
        "advantage": float(sample.advantage),
        "enqueued_at": sample.enqueued_at,
        "pulled_at": float(pulled_at),
    }


def _plain_list(values: Any) -> list:
    """A numpy array or a sequence as a list of Python numbers."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


# -------------------------------------------------------------------- names


def new_segment(now: float | None = None) -> str:
    """A segment id for this trainer process: 8 hex digits of the unix time, then 4 random ones."""
    return f"{int(time.time() if now is None else now):08x}{secrets.token_hex(2)}"


def shard_dir_name(seq: int, segment: str) -> str:
    """The directory of shard `seq` of a segment: 7, "6650a1b2c3d4" -> `shard-000007-6650a1b2c3d4`."""
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError(f"seq={seq!r} must be an int >= 0")
    if not isinstance(segment, str) or not _SEGMENT.fullmatch(segment):
        raise ValueError(f"segment={segment!r} must be 1 to 32 lowercase letters or digits")
    return f"shard-{seq:06d}-{segment}"


def parse_shard_dir_name(name: str) -> tuple[int, str] | None:
    """(seq, segment) of `shard-<seq:06d>-<segment>`, or None for any other name (temporaries, `shard-7-x`)."""
    match = _SHARD_NAME.fullmatch(name)
    if match is None or match[1] != f"{int(match[1]):06d}":
        return None
    return int(match[1]), match[2]


# -------------------------------------------------------------------- manifests


def build_shard_manifest(
    *, seq: int, segment: str, rows: int, groups: int, created_at: str, files: Mapping[str, tuple[int, str]]
) -> dict[str, Any]:
    """The manifest of one shard: its rows and distinct groups, and each file's (size, sha256)."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "kind": EXPERIENCE,
        "name": shard_dir_name(seq, segment),
        "seq": seq,
        "segment": segment,
        "rows": rows,
        "groups": groups,
        "created_at": created_at,
        "files": {name: {"size": size, "sha256": sha} for name, (size, sha) in sorted(files.items())},
    }
    validate_shard_manifest(manifest)  # the writer must never publish what a reader would refuse
    return manifest


def parse_shard_manifest(text: str | bytes, where: str) -> dict[str, Any]:
    """Parse and validate a shard's manifest; `where` names it in error messages."""
    manifest = load_json(text, where)
    validate_shard_manifest(manifest, where)
    return manifest


def validate_shard_manifest(manifest: Any, where: str = "manifest.json") -> None:
    """Raise AdapterRejected unless this is a well-formed shard manifest listing rows.parquet."""
    check_fields(manifest, where, EXPERIENCE, _SHARD_FIELDS)
    if manifest["rows"] < 0 or manifest["groups"] < 0:
        raise AdapterRejected(f"{where}: rows and groups must be >= 0")
    if parse_shard_dir_name(manifest["name"]) != (manifest["seq"], manifest["segment"]):
        raise AdapterRejected(
            f"{where}: name {manifest['name']!r} does not match seq {manifest['seq']} and segment "
            f"{manifest['segment']!r}"
        )
    check_file_entries(manifest, where, (SHARD_FILE,))


# -------------------------------------------------------------------- summaries


def _summary(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    groups = {(r["segment"], r["group_id"]) for r in rows}
    return {
        "groups": len(groups),
        "samples": len(rows),
        # A group whose samples were pulled across a sync can be partly trained and partly dropped; it then
        # counts in both columns (as the trainer's own counts do).
        "trained_groups": len({(r["segment"], r["group_id"]) for r in rows if r["trained"]}),
        "dropped_groups": len({(r["segment"], r["group_id"]) for r in rows if not r["trained"]}),
        "reward_mean": finite_mean(r["reward"] for r in rows),
        "completion_len_mean": finite_mean(len(r["completion_ids"]) for r in rows),
        "staleness_mean": finite_mean(r["staleness"] for r in rows),
    }


def version_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per adapter version, oldest first: groups (distinct (segment, group_id)), samples, trained and
    dropped groups, and the means of reward (NaN skipped), completion length and staleness."""
    by_version: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        by_version[row["model_version"]].append(row)
    return [
        {"version": v, "adapter": by_version[v][0]["adapter"], **_summary(by_version[v])}
        for v in sorted(by_version)
    ]


def total_row(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The same numbers over every row, for the table's last line."""
    return {"version": "all", "adapter": "", **_summary(list(rows))}


_TABLE = (  # header, key, format
    ("version", "version", "d"),
    ("adapter", "adapter", "s"),
    ("groups", "groups", "d"),
    ("samples", "samples", "d"),
    ("trained", "trained_groups", "d"),
    ("dropped", "dropped_groups", "d"),
    ("reward", "reward_mean", ".3f"),
    ("compl_len", "completion_len_mean", ".1f"),
    ("staleness", "staleness_mean", ".2f"),
)


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else value if isinstance(value, str) else format(value, spec)


def format_version_table(table: list[dict[str, Any]], total: dict[str, Any] | None = None) -> str:
    """`version_table` (and `total_row`) as aligned text: a header, then one line per version."""
    cells = [[header for header, _, _ in _TABLE]] + [
        [_cell(r[key], spec) for _, key, spec in _TABLE] for r in [*table, *([total] if total else [])]
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_TABLE))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in cells
    )


# -------------------------------------------------------------------- replay


@dataclass
class _Gap:
    samples: int = 0
    tokens: int = 0
    abs_gap: float = 0.0
    ratio: float = 0.0
    loss: float = 0.0

    def add(self, other: _Gap) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def means(self) -> dict[str, Any]:
        n = self.tokens or math.nan
        return {
            "samples": self.samples,
            "tokens": self.tokens,
            "logprob_gap_mean": self.abs_gap / n,
            "ratio_mean": self.ratio / n,
            "loss": self.loss / n,
        }


def replay_stats(
    rows: Sequence[Mapping[str, Any]], new_logprobs: Sequence[Sequence[float]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """How far stored samples are from a policy that rescored them: per group, and over all rows.

    `new_logprobs[i]` holds the rescoring policy's logprob of each completion token of `rows[i]`. Over the
    trained tokens (completion_mask 1; a sequence's first token has no logprob): the mean |new - stored|
    logprob, the mean importance ratio exp(new - stored), and the GRPO policy loss the samples would give,
    -sum(ratio * advantage) / tokens (TRL's token mean, without the clip).
    """
    groups: dict[tuple[str, int], _Gap] = defaultdict(_Gap)
    for row, new in zip(rows, new_logprobs, strict=True):
        acc = groups[(row["segment"], row["group_id"])]
        acc.samples += 1
        first = 0 if row["prompt_ids"] else 1
        for j in range(first, len(row["completion_ids"])):
            if row["completion_mask"][j]:
                gap = new[j] - row["logprobs"][j]
                acc.tokens += 1
                acc.abs_gap += abs(gap)
                acc.ratio += math.exp(gap)
                acc.loss -= math.exp(gap) * row["advantage"]
    total = _Gap()
    for acc in groups.values():
        total.add(acc)
    per_group = [{"segment": s, "group_id": g, **acc.means()} for (s, g), acc in sorted(groups.items())]
    return per_group, {"groups": len(groups), **total.means()}
