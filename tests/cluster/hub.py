"""A model "downloaded from the hub" without a hub: files laid out as huggingface_hub caches them."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def write_hub_cache(model_dir: Path, hub_cache: Path, repo_id: str) -> Path:
    """Copy `model_dir` into `hub_cache` (what HF_HUB_CACHE points at) as revision `main` of model
    `repo_id`, the way `snapshot_download` leaves it: blobs, a snapshot of links, refs/main. Returns
    the snapshot directory."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in model_dir.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()
    snapshot = repo / "snapshots" / commit
    for src in files:
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, blob)
        link = snapshot / src.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (len(link.relative_to(repo).parts) - 1)) / "blobs" / blob.name)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
