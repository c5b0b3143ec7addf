"""The bucket: where adapter versions, checkpoints, run configs and metrics live, as a directory or an
s3:// prefix.

Layout: `<bucket>/<run_name>/adapters/<adapter_name>-v<N>/` holds the PEFT files and `manifest.json`;
`<bucket>/<run_name>/checkpoints/step-<N>/` holds what the HF Trainer saved at step N and `manifest.json`;
`<bucket>/<run_name>/experience/shard-<seq>-<segment>/` holds `rows.parquet` (rl_cluster.core.experience).
All are committed directories under one rule, kept by the backend (`store.py` says what a backend
does; `directory.py` and `s3.py` are the two, chosen once when a Bucket is made): files first, manifest
last, so a reader that sees a manifest sees every file it lists. Deletion runs in reverse (manifest
first), so no reader ever sees a manifest whose files are gone. A new kind of published directory is
one more `Kind` (`layout.py`, with every name and path) and a publish method that builds its manifest.

This module holds what does not depend on the medium: what a manifest says, what a reader checks.
Readers trust nothing else: `fetch_verified` checks the manifest against the base model and the
replica's max LoRA rank before any file is hashed or downloaded, then every file (size, sha256) before
a path is handed to vLLM; `fetch_checkpoint` checks a checkpoint the same way before a trainer resumes.

`<bucket>/<run_name>/lease.json` says which driver runs the run now (`lease.py`): a driver takes it
before it starts anything and is refused while another one holds it, so one driver at a time writes a run.

Every bucket operation is retried a bounded number of times with exponential backoff; when the bucket
stays unreachable the caller gets BucketUnavailable naming the URI and the last error.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from rl_cluster.bucket.directory import DirectoryStore
from rl_cluster.bucket.layout import (
    ADAPTERS,
    ADAPTERS_DIR,
    CHECKPOINTS,
    CHECKPOINTS_DIR,
    EXPERIENCE_SHARDS,
    Kind,
    adapter_rel,
    checkpoint_rel,
    flat_files,
    lease_rel,
    plain,
    quarantine_rel,
    run_file_rel,
    shard_rel,
)
from rl_cluster.bucket.lease import LEASE_TTL_S, RunLease
from rl_cluster.bucket.s3 import S3Store
from rl_cluster.bucket.store import Manifest, Store
from rl_cluster.core.experience import EXPERIENCE_DIR, SHARD_FILE, build_shard_manifest, parse_shard_dir_name
from rl_cluster.core.manifest import (
    CHECKPOINT_REQUIRED_FILES,
    MANIFEST_NAME,
    REQUIRED_FILES,
    AdapterMeta,
    build_checkpoint_manifest,
    build_manifest,
    check_checkpoint_compatible,
    check_compatible,
    manifest_to_json,
    parse_adapter_dir_name,
    parse_checkpoint_dir_name,
    versions_to_delete,
)
from rl_cluster.core.retry import RetryPolicy
from rl_cluster.errors import AdapterNotFound, AdapterRejected

__all__ = ["ADAPTERS_DIR", "CHECKPOINTS_DIR", "Bucket", "apply_cache_retention"]


class Bucket:
    """A run bucket: a directory every node sees at the same path, or `s3://bucket/prefix`."""

    def __init__(
        self,
        uri: str,
        s3_endpoint_url: str | None = None,
        *,
        attempts: int = 5,
        retry_base_delay_s: float = 0.5,
        retry_max_delay_s: float = 8.0,
        s3_timeout_s: float = 30.0,
    ):
        policy = RetryPolicy(
            attempts=attempts, first_delay_s=retry_base_delay_s, max_delay_s=retry_max_delay_s
        )
        self.s3_endpoint_url = s3_endpoint_url
        self.store: Store = (
            S3Store(uri, policy, s3_endpoint_url, s3_timeout_s)
            if uri.startswith("s3://")
            else DirectoryStore(uri, policy)
        )

    @property
    def uri(self) -> str:
        """The bucket root: an absolute directory path, or `s3://bucket/prefix`."""
        return self.store.uri

    @property
    def is_remote(self) -> bool:
        """Whether readers get a downloaded copy (s3) rather than the bucket's own files (directory)."""
        return isinstance(self.store, S3Store)

    def __repr__(self) -> str:
        return f"Bucket({self.uri!r})"

    # ---------------------------------------------------------------- paths

    def run_uri(self, run_name: str) -> str:
        """Where a run's files live: a directory path, or an s3:// URI."""
        return self.store.uri_of(plain(run_name, "run_name"))

    def adapter_uri(self, run_name: str, adapter_name: str, version: int) -> str:
        """Where version N of an adapter lives (what `publish_adapter` returns)."""
        return self.store.uri_of(adapter_rel(run_name, adapter_name, version))

    def checkpoint_uri(self, run_name: str, step: int) -> str:
        """Where the checkpoint of trainer step N lives (what `publish_checkpoint` returns)."""
        return self.store.uri_of(checkpoint_rel(run_name, step))

    def experience_shard_uri(self, run_name: str, seq: int, segment: str) -> str:
        """Where shard `seq` of a segment lives (what `publish_experience_shard` returns)."""
        return self.store.uri_of(shard_rel(run_name, seq, segment))

    # ---------------------------------------------------------------- run files

    def run_lease(self, run_name: str, ttl_s: float = LEASE_TTL_S) -> RunLease:
        """The run's lease, not yet taken: `acquire()` it before writing anything of the run."""
        return RunLease(self.store, run_name, lease_rel(run_name), ttl_s=ttl_s)

    def write_text(self, run_name: str, relpath: str, text: str) -> str:
        """Write a run file (config.resolved.json, summary.json, metrics.jsonl) atomically; returns its URI."""
        return self.write_bytes(run_name, relpath, text.encode())

    def write_bytes(self, run_name: str, relpath: str, data: bytes) -> str:
        """Write a run file (curves.png, ...) atomically: readers see the old or the new content, never half."""
        rel = run_file_rel(run_name, relpath)
        self.store.write(rel, data)
        return self.store.uri_of(rel)

    def read_text(self, run_name: str, relpath: str) -> str:
        """Read a run file written by `write_text`."""
        return self.read_bytes(run_name, relpath).decode()

    def read_bytes(self, run_name: str, relpath: str) -> bytes:
        """Read a run file written by `write_bytes`."""
        return self.store.read(run_file_rel(run_name, relpath))

    # ---------------------------------------------------------------- publication

    def publish_adapter(
        self,
        run_name: str,
        adapter_name: str,
        version: int,
        src_dir: str | Path,
        meta: AdapterMeta,
    ) -> str:
        """Publish a PEFT `save_pretrained` directory as version N; returns the version's URI.

        Refuses (FileExistsError) a version that already exists: names are never reused, since vLLM keys
        its prefix cache by adapter name and would serve the old policy's KV blocks.
        """
        src = Path(src_dir)
        files = flat_files(src, REQUIRED_FILES, "a PEFT save_pretrained directory")
        peft_rank = json.loads((src / "adapter_config.json").read_text()).get("r")
        if peft_rank is not None and peft_rank != meta.rank:
            raise ValueError(f"{src}: adapter_config.json says r={peft_rank}, but rank={meta.rank} was given")
        build = functools.partial(build_manifest, adapter_name=adapter_name, version=version, meta=meta)
        return self._publish(adapter_rel(run_name, adapter_name, version), files, build, ADAPTERS)

    def publish_checkpoint(
        self, run_name: str, step: int, src_dir: str | Path, *, base_model: str, base_fingerprint: str
    ) -> str:
        """Publish a HF Trainer checkpoint directory (flat: adapter, optimizer, scheduler, RNG and trainer
        state) as `<run>/checkpoints/step-<N>/`; returns its URI.

        The same rule as adapters: files first, manifest last; FileExistsError for a step already published
        (a checkpoint is never overwritten); ValueError for a directory with subdirectories (a DeepSpeed
        `global_step*/`, say: not supported) or without trainer_state.json.
        """
        files = flat_files(Path(src_dir), CHECKPOINT_REQUIRED_FILES, "a HF Trainer checkpoint directory")
        rel = checkpoint_rel(run_name, step)
        build = functools.partial(
            build_checkpoint_manifest, step=step, base_model=base_model, base_fingerprint=base_fingerprint
        )
        return self._publish(rel, files, build, CHECKPOINTS)

    def publish_experience_shard(
        self, run_name: str, seq: int, segment: str, parquet_path: str | Path, *, rows: int, groups: int
    ) -> str:
        """Publish a Parquet file of experience rows (`rows` of them, `groups` distinct groups) as
        `<run>/experience/shard-<seq:06d>-<segment>/rows.parquet`; returns the shard's URI. FileExistsError
        for a (seq, segment) already published."""
        build = functools.partial(build_shard_manifest, seq=seq, segment=segment, rows=rows, groups=groups)
        with tempfile.TemporaryDirectory(prefix="rl_cluster-shard-") as stage:
            staged = Path(stage) / SHARD_FILE  # the file's name in the shard, whatever it is called here
            staged.symlink_to(Path(parquet_path).absolute())
            return self._publish(shard_rel(run_name, seq, segment), [staged], build, EXPERIENCE_SHARDS)

    def _publish(self, rel: str, files: list[Path], build: Callable[..., Manifest], kind: Kind) -> str:
        """Commit `files` as `rel` with the manifest `build(created_at=, files=)` makes of their digests."""
        try:
            self.store.publish(
                rel, files, lambda digests: manifest_to_json(build(created_at=_now(), files=digests)).encode()
            )
        except FileExistsError as e:
            raise FileExistsError(f"{e}; {kind.never_reused}") from None
        return self.store.uri_of(rel)

    # ---------------------------------------------------------------- listing

    def list_versions(self, run_name: str, adapter_name: str) -> list[int]:
        """Committed versions (those with a manifest), oldest first."""
        parse = functools.partial(parse_adapter_dir_name, plain(adapter_name, "adapter_name"))
        return self._committed(f"{plain(run_name, 'run_name')}/{ADAPTERS_DIR}", parse)

    def list_checkpoints(self, run_name: str) -> list[int]:
        """Steps of the committed checkpoints (those with a manifest), oldest first."""
        return self._committed(f"{plain(run_name, 'run_name')}/{CHECKPOINTS_DIR}", parse_checkpoint_dir_name)

    def list_experience_shards(self, run_name: str) -> list[tuple[int, str]]:
        """(seq, segment) of the committed shards (those with a manifest), oldest trainer process first."""
        names = self.store.committed(f"{plain(run_name, 'run_name')}/{EXPERIENCE_DIR}")
        return sorted(filter(None, map(parse_shard_dir_name, names)), key=lambda s: (s[1], s[0]))

    def _committed(self, parent: str, parse: Callable[[str], int | None]) -> list[int]:
        """N of each committed directory under `parent` whose name `parse` maps to N, sorted."""
        return sorted(n for n in map(parse, self.store.committed(parent)) if n is not None)

    # ---------------------------------------------------------------- reading

    def fetch_verified(
        self, version_uri: str, *, cache_dir: str | Path, base_fingerprint: str, max_lora_rank: int
    ) -> Path:
        """A local directory holding the version, verified against its manifest, for vLLM to load.

        Copied into `cache_dir/<run>/adapters/<name>-vN/` (temporary directory, then rename; a directory
        bucket's path must resolve inside the bucket root) and verified there: vLLM loads the copy it
        was checked in, which no writer to the bucket can swap afterwards (it reads the path again after
        an eviction). A few MB per version. Raises AdapterNotFound when no manifest is visible yet (retry later),
        AdapterRejected when the version is not what was published or does not fit this replica,
        BucketUnavailable when unreachable.
        """
        rel, name, manifest = self._manifest(version_uri, ADAPTERS)
        # Before any file is hashed or downloaded: weights that could not be used are not fetched.
        check_compatible(
            manifest, expected_name=name, base_fingerprint=base_fingerprint, max_lora_rank=max_lora_rank
        )
        return self.store.fetch(rel, manifest, Path(cache_dir).absolute(), copy=True)

    def fetch_checkpoint(
        self, checkpoint_uri: str, *, cache_dir: str | Path, base_fingerprint: str | None = None
    ) -> Path:
        """A local directory holding the checkpoint, verified against its manifest, to resume from.

        As `fetch_verified`: in place for a directory bucket (inside the bucket root), downloaded into
        `cache_dir/<run>/checkpoints/step-<N>/` for s3. AdapterNotFound when no manifest is visible,
        AdapterRejected when a file is not what was published (the message names it) or, when
        `base_fingerprint` is given, the checkpoint was trained on another base model.
        """
        rel, name, manifest = self._manifest(checkpoint_uri, CHECKPOINTS)
        check_checkpoint_compatible(manifest, expected_name=name, base_fingerprint=base_fingerprint)
        return self.store.fetch(rel, manifest, Path(cache_dir).absolute())

    def fetch_experience_shard(self, shard_uri: str, *, cache_dir: str | Path) -> Path:
        """The local path of a shard's rows.parquet, verified against its manifest (in place for a directory
        bucket, downloaded into `cache_dir/<run>/experience/<shard>/` for s3). AdapterNotFound while it
        has no manifest; AdapterRejected when the file is not what was published (the message names it)."""
        rel, name, manifest = self._manifest(shard_uri, EXPERIENCE_SHARDS)
        if manifest["name"] != name:
            raise AdapterRejected(
                f"{name}: manifest describes {manifest['name']!r} (copied or renamed shard?)"
            )
        return self.store.fetch(rel, manifest, Path(cache_dir).absolute()) / SHARD_FILE

    def _manifest(self, uri: str, kind: Kind) -> tuple[str, str, Manifest]:
        """(rel, directory name, parsed manifest) of a published directory of this bucket; AdapterRejected
        unless `uri` is one of `kind`, AdapterNotFound while it has no manifest."""
        rel = self.store.locate(uri, kind.article)
        if len(rel) != 3 or rel[1] != kind.subdir or not kind.is_dir_name(rel[2]):
            raise AdapterRejected(
                f"{uri}: not a {kind.noun} directory of {self.uri} (expected <run>/{kind.subdir}/{kind.pattern})"
            )
        name, path = rel[2], "/".join(rel)
        try:
            text = self.store.read(f"{path}/{MANIFEST_NAME}")
        except (FileNotFoundError, NotADirectoryError):
            raise AdapterNotFound(
                f"{name}: no {MANIFEST_NAME} at {self.store.uri_of(path)} (not published yet, or the bucket lags?)"
            ) from None
        return path, name, kind.parse(text, f"{name}/{MANIFEST_NAME}")

    # ---------------------------------------------------------------- retention

    def apply_retention(
        self, run_name: str, adapter_name: str, *, live_window: int, keep_every: int, protected: Iterable[int]
    ) -> list[int]:
        """Delete versions outside the live window, except every K-th and the protected ones; returns them."""
        doomed = versions_to_delete(
            self.list_versions(run_name, adapter_name),
            live_window=live_window,
            keep_every=keep_every,
            protected=set(protected),
        )
        for version in doomed:
            self.store.delete(adapter_rel(run_name, adapter_name, version))
        return doomed

    def quarantine_checkpoint(self, run_name: str, step: int) -> str:
        """Move a checkpoint that failed verification to `<run>/quarantine/step-N-<time>/`; returns where.
        Left in place it would still be the newest to retention (which then deletes a good one) and its
        step could never be published again: a resumed run reaching that step would die on it."""
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        rel = quarantine_rel(run_name, step, stamp)
        self.store.move(checkpoint_rel(run_name, step), rel)
        return self.store.uri_of(rel)

    def apply_checkpoint_retention(self, run_name: str, *, keep_last: int) -> list[int]:
        """Delete all but the newest `keep_last` checkpoints (manifest first); returns their steps."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(
                f"keep_last={keep_last!r} must be an int >= 1: the newest checkpoint is always kept"
            )
        doomed = versions_to_delete(self.list_checkpoints(run_name), live_window=keep_last, keep_every=0)
        for step in doomed:
            self.store.delete(checkpoint_rel(run_name, step))
        return doomed


def apply_cache_retention(
    cache_dir: str | Path,
    run_name: str,
    adapter_name: str,
    *,
    live_window: int,
    keep_every: int,
    protected: Iterable[int],
) -> list[int]:
    """The bucket's retention rule applied to a generator's local cache (`cache_dir/<run>/adapters/`).

    The cache has the bucket's layout and commit rule, so it is a directory bucket; its disk is local,
    so nothing is retried."""
    return Bucket(str(cache_dir), attempts=1).apply_retention(
        run_name, adapter_name, live_window=live_window, keep_every=keep_every, protected=protected
    )


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")
