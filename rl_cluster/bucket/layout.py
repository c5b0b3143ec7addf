"""What lives where in a bucket: the kinds of committed directory, the names of every path `Bucket` hands
a store, and which local files may be published. Names are checked here, so a store never climbs out of
its root.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from rl_cluster.bucket.store import Manifest
from rl_cluster.core.experience import (
    EXPERIENCE_DIR,
    parse_shard_dir_name,
    parse_shard_manifest,
    shard_dir_name,
)
from rl_cluster.core.manifest import (
    ADAPTER,
    CHECKPOINT,
    MANIFEST_NAME,
    adapter_dir_name,
    checkpoint_dir_name,
    parse_checkpoint_dir_name,
    parse_manifest,
    split_adapter_dir_name,
)

ADAPTERS_DIR = "adapters"
CHECKPOINTS_DIR = "checkpoints"
QUARANTINE_DIR = "quarantine"
LEASE_FILE = "lease.json"  # who drives the run now (lease.py)


@dataclass(frozen=True)
class Kind:
    """What differs between the kinds of published directory; publication, listing, verification and
    deletion are shared."""

    parse: Callable[[str | bytes, str], Manifest]  # (manifest text, where) -> the validated manifest
    subdir: str  # the directory under `<run>/`
    noun: str  # in messages: "not a <noun> directory"
    article: str  # in messages: "'..' in <article> path"
    pattern: str  # how a directory is named, in messages
    is_dir_name: Callable[[str], bool]
    never_reused: str  # why publishing over an existing one is refused


ADAPTERS = Kind(
    functools.partial(parse_manifest, kind=ADAPTER),
    ADAPTERS_DIR,
    "version",
    "an adapter",
    "<name>-v<N>",
    lambda name: split_adapter_dir_name(name) is not None,
    "adapter names are never reused",
)
CHECKPOINTS = Kind(
    functools.partial(parse_manifest, kind=CHECKPOINT),
    CHECKPOINTS_DIR,
    "checkpoint",
    "a checkpoint",
    "step-<N>",
    lambda name: parse_checkpoint_dir_name(name) is not None,
    "checkpoints are never overwritten",
)
EXPERIENCE_SHARDS = Kind(
    parse_shard_manifest,
    EXPERIENCE_DIR,
    "shard",
    "an experience shard",
    "shard-<seq:06d>-<segment>",
    lambda name: parse_shard_dir_name(name) is not None,
    "a shard's (seq, segment) is never reused",
)


def plain(name: str, what: str) -> str:
    """A single path segment that cannot climb out of its parent or hide from listings."""
    if not name or name.startswith(".") or "/" in name or "\\" in name:
        raise ValueError(f"{what}={name!r} must be a plain name (no '/', not starting with '.')")
    return name


def adapter_rel(run_name: str, adapter_name: str, version: int) -> str:
    name = adapter_dir_name(plain(adapter_name, "adapter_name"), version)
    return f"{plain(run_name, 'run_name')}/{ADAPTERS_DIR}/{name}"


def checkpoint_rel(run_name: str, step: int) -> str:
    return f"{plain(run_name, 'run_name')}/{CHECKPOINTS_DIR}/{checkpoint_dir_name(step)}"


def shard_rel(run_name: str, seq: int, segment: str) -> str:
    return f"{plain(run_name, 'run_name')}/{EXPERIENCE_DIR}/{shard_dir_name(seq, segment)}"


def quarantine_rel(run_name: str, step: int, stamp: str) -> str:
    """Where a checkpoint that failed verification is kept for a person to look at: out of
    `checkpoints/`, so no listing, retention or resume counts it, and its step can be published again."""
    return f"{plain(run_name, 'run_name')}/{QUARANTINE_DIR}/{checkpoint_dir_name(step)}-{stamp}"


def lease_rel(run_name: str) -> str:
    return f"{plain(run_name, 'run_name')}/{LEASE_FILE}"


def run_file_rel(run_name: str, relpath: str) -> str:
    parts = PurePosixPath(relpath).parts
    if not parts or PurePosixPath(relpath).is_absolute() or any(p in (".", "..") for p in parts):
        raise ValueError(f"relpath={relpath!r} must be a relative path without '..'")
    return "/".join([plain(run_name, "run_name"), *parts])


def flat_files(src_dir: Path, required: Iterable[str], what: str) -> list[Path]:
    """The files of a directory to publish, checked before anything is written: plain files only (no
    subdirectories), none named manifest.json, every `required` one present."""
    entries = sorted(src_dir.iterdir())
    nested = [p.name for p in entries if not p.is_file()]
    if nested:
        raise ValueError(f"{src_dir}: only plain files can be published, found {nested}")
    names = {p.name for p in entries}
    if MANIFEST_NAME in names:
        raise ValueError(f"{src_dir}: contains {MANIFEST_NAME}, a name the bucket protocol reserves")
    absent = [name for name in required if name not in names]
    if absent:
        raise ValueError(f"{src_dir}: lacks {', '.join(absent)}; is it {what}?")
    return entries
