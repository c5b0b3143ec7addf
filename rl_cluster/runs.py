"""The runs a bucket holds, and what each one's summary.json says: `rl-cluster runs` and `rl-cluster summary`.

A run is a directory `<bucket>/<run_name>/` holding `config.resolved.json` (every run writes it before it
starts anything, rl_cluster.run) or `summary.json` (written when it ends, however it ends). A run with the
first and not the second is still running, or its driver was killed before it could write one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rl_cluster.bucket import Bucket
from rl_cluster.config import BucketConfig
from rl_cluster.data import PREPARED_ROOT
from rl_cluster.errors import UsageError

DEFAULT_BUCKET = BucketConfig.model_fields["uri"].default  # what a config without [bucket] uses
RUN_MARKERS = ("config.resolved.json", "summary.json")
NO_SUMMARY = "running or lost"


def run_names(bucket: Bucket, marked: bool = True) -> list[str]:
    """The runs in the bucket, sorted by name; `marked` False: every directory that may hold a run's
    files (what a test or a tool wrote without the run markers). UsageError when there is no bucket."""
    if bucket.is_remote:
        fs, root = bucket.store.fs, bucket.store.root
        if not fs.exists(root):
            raise UsageError(f"no bucket at {bucket.uri}")
        entries = [e["name"].rsplit("/", 1)[-1] for e in fs.ls(root, detail=True) if e["type"] == "directory"]
        exists = fs.exists
    else:
        root = Path(bucket.uri)
        if not root.is_dir():
            raise UsageError(f"no bucket at {bucket.uri} (a directory, or s3://bucket/prefix)")
        entries = [p.name for p in root.iterdir() if p.is_dir()]
        exists = lambda path: Path(path).is_file()  # noqa: E731
    names = [n for n in entries if not n.startswith((".", "_")) and n != PREPARED_ROOT]
    return sorted(n for n in names if not marked or any(exists(f"{root}/{n}/{m}") for m in RUN_MARKERS))


def not_found(bucket: Bucket, run_name: str) -> UsageError:
    """That a run is not in the bucket, naming the runs that are (when they are few enough to read)."""
    names = run_names(bucket)
    if not names:
        there = "it holds no runs"
    elif len(names) <= 10:
        there = "runs there: " + ", ".join(names)
    else:
        there = f"{len(names)} runs there: rl-cluster runs --bucket {bucket.uri}"
    return UsageError(f"no run named {run_name!r} in {bucket.uri} ({there})")


def read_summary(bucket: Bucket, run_name: str) -> dict | None:
    """The run's summary.json; None while it has none (running or lost); UsageError when no such run."""
    try:
        return json.loads(bucket.read_text(run_name, "summary.json"))
    except FileNotFoundError:
        if run_name in run_names(bucket):
            return None
        raise not_found(bucket, run_name) from None


def _number(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def run_row(name: str, summary: dict | None) -> dict:
    """What `rl-cluster runs` shows of one run: status, steps, the mean reward of the last fifth of its
    steps, and pass@1 of its last held-out eval (None where it has none)."""
    if summary is None:
        return {"run": name, "status": NO_SUMMARY, "steps": None, "reward": None, "pass@1": None}
    last_eval = (summary.get("eval") or {}).get("last") or {}
    return {
        "run": name,
        "status": summary.get("status", "?"),
        "steps": summary.get("steps"),
        "reward": summary.get("reward_last_fifth"),
        "pass@1": last_eval.get("pass@1"),
    }


def runs_table(rows: list[dict]) -> str:
    header = {
        "run": "run",
        "status": "status",
        "steps": "steps",
        "reward": "final reward",
        "pass@1": "eval pass@1",
    }
    cells = [header] + [
        {
            "run": r["run"],
            "status": r["status"],
            "steps": _number(r["steps"], "d"),
            "reward": _number(r["reward"], ".3f"),
            "pass@1": _number(r["pass@1"], ".3f"),
        }
        for r in rows
    ]
    width = {k: max(len(c[k]) for c in cells) for k in header}
    left = {"run", "status"}
    return "\n".join(
        "  ".join(c[k].ljust(width[k]) if k in left else c[k].rjust(width[k]) for k in header).rstrip()
        for c in cells
    )
