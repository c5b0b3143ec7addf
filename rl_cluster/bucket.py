"""The bucket: where adapter versions, checkpoints, run configs and metrics live, as a directory or an
s3:// prefix.

Layout: `<bucket>/<run_name>/adapters/<adapter_name>-v<N>/` holds the PEFT files and `manifest.json`;
`<bucket>/<run_name>/checkpoints/step-<N>/` holds what the HF Trainer saved at step N and `manifest.json`.
Both go through the same code. Publication is files first, manifest last, so a reader that sees a manifest
sees every file it lists:
  - directory: everything goes into a dot-prefixed temporary directory (listings skip it), is fsynced,
    and the directory is renamed into place in one step;
  - s3: the files are uploaded, then the manifest; an S3 PUT is atomic, so its presence is the commit.
Readers trust nothing else: `fetch_verified` checks the manifest against every file (size, sha256), the
base model and the replica's max LoRA rank before a path is handed to vLLM; `fetch_checkpoint` checks a
checkpoint's files the same way before a trainer resumes from it. Deletion runs in reverse (manifest
first), so no reader ever sees a manifest whose files are gone.

Every bucket operation is retried a bounded number of times with exponential backoff; when the bucket
stays unreachable the caller gets BucketUnavailable naming the URI and the last error.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from rl_cluster.core.manifest import (
    ADAPTER,
    CHECKPOINT,
    CHECKPOINT_REQUIRED_FILES,
    MANIFEST_NAME,
    REQUIRED_FILES,
    adapter_dir_name,
    build_checkpoint_manifest,
    build_manifest,
    check_checkpoint_compatible,
    check_compatible,
    check_files,
    checkpoint_dir_name,
    manifest_to_json,
    parse_adapter_dir_name,
    parse_checkpoint_dir_name,
    parse_manifest,
    sha256_of,
    split_adapter_dir_name,
    versions_to_delete,
)
from rl_cluster.errors import AdapterError, AdapterNotFound, AdapterRejected, BucketUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

ADAPTERS_DIR = "adapters"
CHECKPOINTS_DIR = "checkpoints"
_CHUNK = 1 << 20
# Errors that say something definite about the request, not about reachability: retrying cannot help.
_DEFINITIVE = (
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    AdapterError,
    ValueError,
    TypeError,
)
Digests = Mapping[str, tuple[int, str]]  # file name -> (size, sha256)
Manifest = dict[str, Any]


@dataclass(frozen=True)
class _Kind:
    """What differs between the kinds of published directory; publication, listing, verification and
    deletion are shared."""

    manifest_kind: str  # the manifest's `kind`
    subdir: str  # the directory under `<run>/`
    noun: str  # in messages: "not a <noun> directory"
    article: str  # in messages: "'..' in <article> path"
    pattern: str  # how a directory is named, in messages
    is_dir_name: Callable[[str], bool]
    never_reused: str  # why publishing over an existing one is refused
    cache_under_subdir: bool  # cached as `<cache>/<run>/<subdir>/<name>` (else `<cache>/<run>/<name>`)


_ADAPTERS = _Kind(
    ADAPTER,
    ADAPTERS_DIR,
    "version",
    "an adapter",
    "<name>-v<N>",
    lambda name: split_adapter_dir_name(name) is not None,
    "adapter names are never reused",
    cache_under_subdir=False,  # the generators' cache layout (apply_cache_retention) predates checkpoints
)
_CHECKPOINTS = _Kind(
    CHECKPOINT,
    CHECKPOINTS_DIR,
    "checkpoint",
    "a checkpoint",
    "step-<N>",
    lambda name: parse_checkpoint_dir_name(name) is not None,
    "checkpoints are never overwritten",
    cache_under_subdir=True,
)


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
        if attempts < 1:
            raise ValueError(f"attempts={attempts} must be >= 1")
        self.is_remote = uri.startswith("s3://")
        self.s3_endpoint_url = s3_endpoint_url
        self.attempts = attempts
        self.retry_base_delay_s = retry_base_delay_s
        self.retry_max_delay_s = retry_max_delay_s
        self.s3_timeout_s = s3_timeout_s
        self._s3: Any = None  # s3fs.S3FileSystem, made on first use (and not pickled: see __getstate__)
        if self.is_remote:
            self._root = uri.removeprefix("s3://").strip("/")
            if not self._root or ".." in self._root.split("/"):
                raise ValueError(f"bucket uri {uri!r} must look like s3://bucket[/prefix]")
            self.uri = f"s3://{self._root}"
        else:
            self._root = str(Path(uri.removeprefix("file://")).expanduser().absolute())
            self.uri = self._root

    def __repr__(self) -> str:
        return f"Bucket({self.uri!r})"

    def __getstate__(self) -> dict[str, Any]:
        # Buckets travel to Ray actors; each process makes its own S3 client (they hold event loops).
        return {**self.__dict__, "_s3": None}

    # ---------------------------------------------------------------- paths

    def run_uri(self, run_name: str) -> str:
        """Where a run's files live: a directory path, or an s3:// URI."""
        return self._uri(self._path(_plain(run_name, "run_name")))

    def adapter_uri(self, run_name: str, adapter_name: str, version: int) -> str:
        """Where version N of an adapter lives (what `publish_adapter` returns)."""
        return self._uri(self._version_path(run_name, adapter_name, version))

    def checkpoint_uri(self, run_name: str, step: int) -> str:
        """Where the checkpoint of trainer step N lives (what `publish_checkpoint` returns)."""
        return self._uri(self._checkpoint_path(run_name, step))

    def _path(self, *parts: str) -> str:
        """Bucket-internal path: an absolute directory path, or `bucket/prefix/...` for s3fs."""
        return "/".join([self._root, *parts])

    def _uri(self, path: str) -> str:
        return f"s3://{path}" if self.is_remote else path

    def _version_path(self, run_name: str, adapter_name: str, version: int) -> str:
        name = adapter_dir_name(_plain(adapter_name, "adapter_name"), version)
        return self._path(_plain(run_name, "run_name"), ADAPTERS_DIR, name)

    def _checkpoint_path(self, run_name: str, step: int) -> str:
        return self._path(_plain(run_name, "run_name"), CHECKPOINTS_DIR, checkpoint_dir_name(step))

    # ---------------------------------------------------------------- retries

    def _retry(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn, retrying errors that may be transient (network, I/O) with exponential backoff."""
        started = time.monotonic()
        for attempt in range(1, self.attempts + 1):
            try:
                return fn(*args, **kwargs)
            except _DEFINITIVE:
                raise
            except Exception as e:  # connection refused, timeouts, 5xx, EIO on a mount: maybe transient
                last = e
                if attempt < self.attempts:
                    delay = min(self.retry_base_delay_s * 2 ** (attempt - 1), self.retry_max_delay_s)
                    log.warning(
                        "%s: %s: %s (attempt %d/%d, retrying in %.2fs)",
                        *(self.uri, what, e, attempt, self.attempts, delay),
                    )
                    time.sleep(delay)
        raise BucketUnavailable(
            f"bucket {self.uri} unreachable: {what} failed {self.attempts} times in "
            f"{time.monotonic() - started:.1f}s; last error: {type(last).__name__}: {last}"
        ) from last

    @property
    def s3(self) -> Any:
        """The s3fs filesystem (s3 buckets only)."""
        if not self.is_remote:
            raise AttributeError(f"{self.uri} is a directory bucket; it has no S3 client")
        if self._s3 is None:
            import s3fs  # only s3 users pay for the import

            client_kwargs = {"endpoint_url": self.s3_endpoint_url, "region_name": "us-east-1"}
            self._s3 = s3fs.S3FileSystem(
                client_kwargs=client_kwargs if self.s3_endpoint_url else {},
                # One retry loop (ours) so that "bounded" means what it says.
                config_kwargs={
                    "connect_timeout": self.s3_timeout_s,
                    "read_timeout": self.s3_timeout_s,
                    "retries": {"mode": "standard", "total_max_attempts": 1},
                },
                use_listings_cache=False,  # a cached listing would hide new versions
                skip_instance_cache=True,
            )
            self._s3.retries = 1
        return self._s3

    def _s3_exists(self, path: str) -> bool:
        """Whether an object exists: one HEAD (s3fs's `exists`/`info` also list the prefix on a miss)."""
        bucket, key, _ = self.s3.split_path(path)
        try:
            self.s3.call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False
        return True

    # ---------------------------------------------------------------- run files

    def write_text(self, run_name: str, relpath: str, text: str) -> str:
        """Write a run file (config.resolved.json, summary.json, metrics.jsonl) atomically; returns its URI."""
        return self.write_bytes(run_name, relpath, text.encode())

    def write_bytes(self, run_name: str, relpath: str, data: bytes) -> str:
        """Write a run file (curves.png, ...) atomically: readers see the old or the new content, never half."""
        path = self._path(_plain(run_name, "run_name"), *_relparts(relpath))
        if self.is_remote:
            self._retry(f"write {path}", self.s3.pipe_file, path, data)
        else:
            self._retry(f"write {path}", _atomic_write, Path(path), data)
        return self._uri(path)

    def read_text(self, run_name: str, relpath: str) -> str:
        """Read a run file written by `write_text`."""
        return self.read_bytes(run_name, relpath).decode()

    def read_bytes(self, run_name: str, relpath: str) -> bytes:
        """Read a run file written by `write_bytes`."""
        path = self._path(_plain(run_name, "run_name"), *_relparts(relpath))
        read = self.s3.cat_file if self.is_remote else (lambda p: Path(p).read_bytes())
        return self._retry(f"read {path}", read, path)

    # ---------------------------------------------------------------- publication

    def publish_adapter(
        self,
        run_name: str,
        adapter_name: str,
        version: int,
        src_dir: str | Path,
        *,
        base_model: str,
        base_fingerprint: str,
        rank: int,
        alpha: float,
        target_modules: str | list[str],
        trainer_step: int,
    ) -> str:
        """Publish a PEFT `save_pretrained` directory as version N; returns the version's URI.

        Refuses (FileExistsError) a version that already exists: names are never reused, since vLLM keys
        its prefix cache by adapter name and would serve the old policy's KV blocks.
        """
        src = Path(src_dir)
        files = _flat_files(src, REQUIRED_FILES, "a PEFT save_pretrained directory")
        peft_rank = json.loads((src / "adapter_config.json").read_text()).get("r")
        if peft_rank is not None and peft_rank != rank:
            raise ValueError(f"{src}: adapter_config.json says r={peft_rank}, but rank={rank} was given")
        final = self._version_path(run_name, adapter_name, version)

        def manifest(digests: Digests) -> Manifest:
            return build_manifest(
                adapter_name=adapter_name,
                version=version,
                base_model=base_model,
                base_fingerprint=base_fingerprint,
                rank=rank,
                alpha=alpha,
                target_modules=target_modules,
                trainer_step=trainer_step,
                created_at=_now(),
                files=digests,
            )

        return self._publish(final, files, manifest, _ADAPTERS)

    def publish_checkpoint(
        self, run_name: str, step: int, src_dir: str | Path, *, base_model: str, base_fingerprint: str
    ) -> str:
        """Publish a HF Trainer checkpoint directory (flat: adapter, optimizer, scheduler, RNG and trainer
        state) as `<run>/checkpoints/step-<N>/`; returns its URI.

        The same rule as adapters: files first, manifest last; FileExistsError for a step already published
        (a checkpoint is never overwritten); ValueError for a directory with subdirectories (a DeepSpeed
        `global_step*/`, say: not supported) or without trainer_state.json.
        """
        files = _flat_files(Path(src_dir), CHECKPOINT_REQUIRED_FILES, "a HF Trainer checkpoint directory")
        final = self._checkpoint_path(run_name, step)

        def manifest(digests: Digests) -> Manifest:
            return build_checkpoint_manifest(
                step=step,
                base_model=base_model,
                base_fingerprint=base_fingerprint,
                created_at=_now(),
                files=digests,
            )

        return self._publish(final, files, manifest, _CHECKPOINTS)

    def _publish(
        self, final: str, files: list[Path], manifest: Callable[[Digests], Manifest], kind: _Kind
    ) -> str:
        """Publish `files` as the directory `final`, committed by `manifest(their digests)`."""
        if self.is_remote:
            self._publish_s3(final, files, manifest, kind)
        else:
            self._retry(f"publish {final}", _publish_dir, Path(final), files, manifest, kind.never_reused)
        return self._uri(final)

    def _publish_s3(
        self, final: str, files: list[Path], manifest: Callable[[Digests], Manifest], kind: _Kind
    ) -> None:
        manifest_path = f"{final}/{MANIFEST_NAME}"
        if self._retry(f"check {manifest_path}", self._s3_exists, manifest_path):
            raise FileExistsError(f"{self._uri(final)} is already published; {kind.never_reused}")
        try:
            digests = {}
            for src in files:
                data = src.read_bytes()  # one read: what is hashed is exactly what is uploaded
                digests[src.name] = sha256_of([data])
                self._retry(f"upload {final}/{src.name}", self.s3.pipe_file, f"{final}/{src.name}", data)
            text = manifest_to_json(manifest(digests))
            self._retry(f"commit {manifest_path}", self.s3.pipe_file, manifest_path, text.encode())
        except BaseException:
            # Files without a manifest are invisible to readers already; tidy up if the bucket lets us.
            try:
                self._s3_delete_version(final)
            except Exception as e:
                log.warning("could not remove the unfinished %s: %s", final, e)
            raise

    def list_versions(self, run_name: str, adapter_name: str) -> list[int]:
        """Committed versions (those with a manifest), oldest first."""
        _plain(adapter_name, "adapter_name")
        adapters = self._path(_plain(run_name, "run_name"), ADAPTERS_DIR)
        return self._list(adapters, lambda name: parse_adapter_dir_name(adapter_name, name))

    def list_checkpoints(self, run_name: str) -> list[int]:
        """Steps of the committed checkpoints (those with a manifest), oldest first."""
        return self._list(
            self._path(_plain(run_name, "run_name"), CHECKPOINTS_DIR), parse_checkpoint_dir_name
        )

    def _list(self, parent: str, parse: Callable[[str], int | None]) -> list[int]:
        """N of each `parent/<name>/manifest.json` whose name `parse` maps to N, sorted."""
        if not self.is_remote:
            return self._retry(f"list {parent}", _dir_versions, Path(parent), parse)
        try:
            keys = self._retry(f"list {parent}", self.s3.find, parent)
        except FileNotFoundError:
            return []
        versions = set()
        for key in keys:
            parts = key[len(parent) + 1 :].split("/")
            if len(parts) == 2 and parts[1] == MANIFEST_NAME:
                version = parse(parts[0])
                if version is not None:
                    versions.add(version)
        return sorted(versions)

    # ---------------------------------------------------------------- reading

    def fetch_verified(
        self, version_uri: str, *, cache_dir: str | Path, base_fingerprint: str, max_lora_rank: int
    ) -> Path:
        """A local directory holding the version, verified against its manifest, for vLLM to load.

        Directory bucket: verified in place (the path must resolve inside the bucket root). s3 bucket:
        downloaded into `cache_dir/<run>/<name>-vN/` (temporary directory, then rename) and verified there.
        Raises AdapterNotFound when no manifest is visible yet (retry later), AdapterRejected when the
        version is not what was published or does not fit this replica, BucketUnavailable when unreachable.
        """

        def precheck(manifest: Manifest, name: str) -> None:
            check_compatible(
                manifest, expected_name=name, base_fingerprint=base_fingerprint, max_lora_rank=max_lora_rank
            )

        return self._fetch(version_uri, _ADAPTERS, cache_dir, precheck)

    def fetch_checkpoint(
        self, checkpoint_uri: str, *, cache_dir: str | Path, base_fingerprint: str | None = None
    ) -> Path:
        """A local directory holding the checkpoint, verified against its manifest, to resume from.

        As `fetch_verified`: in place for a directory bucket (inside the bucket root), downloaded into
        `cache_dir/<run>/checkpoints/step-<N>/` for s3. AdapterNotFound when no manifest is visible,
        AdapterRejected when a file is not what was published (the message names it) or, when
        `base_fingerprint` is given, the checkpoint was trained on another base model.
        """

        def precheck(manifest: Manifest, name: str) -> None:
            check_checkpoint_compatible(manifest, expected_name=name, base_fingerprint=base_fingerprint)

        return self._fetch(checkpoint_uri, _CHECKPOINTS, cache_dir, precheck)

    def _fetch(
        self, uri: str, kind: _Kind, cache_dir: str | Path, precheck: Callable[[Manifest, str], None]
    ) -> Path:
        """Verified local directory of a published one; `precheck(manifest, name)` runs before any file
        is hashed or downloaded."""
        run_name, name = self._locate(uri, kind)
        if not self.is_remote:
            root = Path(self._root).resolve()
            published = Path(self._path(run_name, kind.subdir, name))
            return self._retry(
                f"verify {published}", _verify_dir, published, root=root, kind=kind, precheck=precheck
            )
        cached = Path(cache_dir).absolute() / run_name
        cached = (cached / kind.subdir if kind.cache_under_subdir else cached) / name
        if (cached / MANIFEST_NAME).is_file():
            try:
                return _verify_dir(cached, root=None, kind=kind, precheck=precheck)
            except AdapterRejected as e:
                log.warning("cached copy %s is bad (%s); downloading it again", cached, e)
                _delete_dir_version(cached)
        return self._download(self._path(run_name, kind.subdir, name), cached, kind, precheck)

    def _locate(self, version_uri: str, kind: _Kind) -> tuple[str, str]:
        """(run_name, directory name) of a version or checkpoint URI; AdapterRejected unless it is one of
        this bucket."""
        if self.is_remote:
            if not version_uri.startswith("s3://"):
                raise AdapterRejected(f"{version_uri}: not an s3:// URI, but the bucket is {self.uri}")
            parts = version_uri.removeprefix("s3://").rstrip("/").split("/")
            if any(part in ("", ".", "..") for part in parts):
                raise AdapterRejected(f"{version_uri}: empty, '.' or '..' path segments are refused")
            root = self._root.split("/")
            if parts[: len(root)] != root:
                raise AdapterRejected(f"{version_uri}: outside the bucket root {self.uri}")
            rel = parts[len(root) :]
        else:
            path = Path(version_uri.removeprefix("file://")).expanduser()
            if ".." in path.parts:
                raise AdapterRejected(f"{version_uri}: '..' in {kind.article} path is refused")
            root = Path(self._root).resolve()
            path = path.absolute()
            resolved = path.resolve()  # follows symlinks: a link pointing out of the bucket is caught here
            parent = path.parent.resolve()
            if not resolved.is_relative_to(root) or not parent.is_relative_to(root):
                raise AdapterRejected(
                    f"{version_uri}: resolves to {resolved}, outside the bucket root {root}"
                )
            # The name as given (not as resolved): a link `p-v3 -> p-v2` must fail the manifest name check.
            rel = [*parent.relative_to(root).parts, path.name]
        if len(rel) != 3 or rel[1] != kind.subdir or not kind.is_dir_name(rel[2]):
            raise AdapterRejected(
                f"{version_uri}: not a {kind.noun} directory of {self.uri} "
                f"(expected <run>/{kind.subdir}/{kind.pattern})"
            )
        return rel[0], rel[2]

    def _download(self, src: str, dest: Path, kind: _Kind, precheck: Callable[[Manifest, str], None]) -> Path:
        name = dest.name
        try:
            text = self._retry(f"read {src}/{MANIFEST_NAME}", self.s3.cat_file, f"{src}/{MANIFEST_NAME}")
        except FileNotFoundError:
            raise AdapterNotFound(f"{name}: no {MANIFEST_NAME} at s3://{src} (not published yet?)") from None
        manifest = parse_manifest(text, where=f"{name}/{MANIFEST_NAME}", kind=kind.manifest_kind)
        precheck(manifest, name)  # before downloading weights that could not be used anyway
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            observed: dict[str, tuple[int, str] | None] = {}
            for file in manifest["files"]:
                try:
                    data = self._retry(f"download {src}/{file}", self.s3.cat_file, f"{src}/{file}")
                except FileNotFoundError:
                    observed[file] = None
                    continue
                _write_synced(tmp / file, data)
                observed[file] = sha256_of([data])
            check_files(manifest, observed)
            _write_synced(tmp / MANIFEST_NAME, text)  # last, as in the bucket
            _fsync_dir(tmp)
            try:
                os.rename(tmp, dest)
            except OSError:
                if not (dest / MANIFEST_NAME).is_file():
                    raise
                # Another process on this node fetched it first; its copy passed the same checks.
            _fsync_dir(dest.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

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
            self._delete(self._version_path(run_name, adapter_name, version))
        return doomed

    def apply_checkpoint_retention(self, run_name: str, *, keep_last: int) -> list[int]:
        """Delete all but the newest `keep_last` checkpoints (manifest first); returns their steps."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(
                f"keep_last={keep_last!r} must be an int >= 1: the newest checkpoint is always kept"
            )
        doomed = versions_to_delete(self.list_checkpoints(run_name), live_window=keep_last, keep_every=0)
        for step in doomed:
            self._delete(self._checkpoint_path(run_name, step))
        return doomed

    def _delete(self, path: str) -> None:
        """Remove a published directory, manifest first: it stops existing for readers before any file goes."""
        if self.is_remote:
            self._retry(f"delete {path}", self._s3_delete_version, path)
        else:
            self._retry(f"delete {path}", _delete_dir_version, Path(path))

    def _s3_delete_version(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.s3.rm_file(f"{path}/{MANIFEST_NAME}")  # first: the version stops existing for readers
        with contextlib.suppress(FileNotFoundError):
            self.s3.rm(path, recursive=True)


def apply_cache_retention(
    cache_dir: str | Path,
    run_name: str,
    adapter_name: str,
    *,
    live_window: int,
    keep_every: int,
    protected: Iterable[int],
) -> list[int]:
    """The bucket's retention rule applied to a generator's local cache (`cache_dir/<run>/<name>-vN`)."""
    run_dir = Path(cache_dir) / _plain(run_name, "run_name")
    _plain(adapter_name, "adapter_name")
    doomed = versions_to_delete(
        _dir_versions(run_dir, lambda name: parse_adapter_dir_name(adapter_name, name)),
        live_window=live_window,
        keep_every=keep_every,
        protected=set(protected),
    )
    for version in doomed:
        _delete_dir_version(run_dir / adapter_dir_name(adapter_name, version))
    return doomed


# -------------------------------------------------------------------- local-directory helpers


def _plain(name: str, what: str) -> str:
    """A single path segment that cannot climb out of its parent or hide from listings."""
    if not name or name.startswith(".") or "/" in name or "\\" in name:
        raise ValueError(f"{what}={name!r} must be a plain name (no '/', not starting with '.')")
    return name


def _relparts(relpath: str) -> list[str]:
    parts = PurePosixPath(relpath).parts
    if not parts or PurePosixPath(relpath).is_absolute() or any(p in (".", "..") for p in parts):
        raise ValueError(f"relpath={relpath!r} must be a relative path without '..'")
    return list(parts)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


def _flat_files(src_dir: Path, required: Iterable[str], what: str) -> list[Path]:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        _write_synced(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _copy_hashed(src: Path, dest: Path) -> tuple[int, str]:
    """Copy a file and return (size, sha256) of the bytes actually written."""
    with open(src, "rb") as fin, open(dest, "wb") as fout:

        def chunks() -> Iterable[bytes]:
            while chunk := fin.read(_CHUNK):
                fout.write(chunk)
                yield chunk

        digest = sha256_of(chunks())
        fout.flush()
        os.fsync(fout.fileno())
    return digest


def _hash_file(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        return sha256_of(iter(lambda: f.read(_CHUNK), b""))


def _publish_dir(
    final: Path, files: list[Path], manifest: Callable[[Digests], Manifest], never_reused: str
) -> None:
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        raise FileExistsError(f"{final} is already published; {never_reused}")
    tmp = parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"  # dot: listings skip it
    tmp.mkdir()
    try:
        digests = {src.name: _copy_hashed(src, tmp / src.name) for src in files}
        _write_synced(tmp / MANIFEST_NAME, manifest_to_json(manifest(digests)).encode())
        _fsync_dir(tmp)
        os.rename(tmp, final)  # the commit: the whole version appears at once
        _fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; a leftover after a failure


def _dir_versions(directory: Path, parse: Callable[[str], int | None]) -> list[int]:
    """N of each subdirectory that `parse` maps to N and that has a manifest, sorted."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    versions = []
    for entry in entries:
        version = parse(entry.name)
        if version is not None and os.path.isfile(os.path.join(entry.path, MANIFEST_NAME)):
            versions.append(version)
    return sorted(versions)


def _verify_dir(
    version_dir: Path, *, root: Path | None, kind: _Kind, precheck: Callable[[Manifest, str], None]
) -> Path:
    """Check a published directory against its manifest (`precheck(manifest, name)` first); `root`, when
    given, is where every file must lie."""
    name = version_dir.name
    manifest_path = version_dir / MANIFEST_NAME
    try:
        text = manifest_path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        raise AdapterNotFound(
            f"{name}: no {MANIFEST_NAME} in {version_dir} (not published yet, or the mount lags?)"
        ) from None
    manifest = parse_manifest(text, where=f"{name}/{MANIFEST_NAME}", kind=kind.manifest_kind)
    precheck(manifest, name)
    observed: dict[str, tuple[int, str] | None] = {}
    for file in [MANIFEST_NAME, *manifest["files"]]:
        path = version_dir / file
        # vLLM follows symlinks, so a file linked out of the bucket would be loaded from elsewhere.
        if root is not None and not path.resolve().is_relative_to(root):
            raise AdapterRejected(f"{file}: resolves to {path.resolve()}, outside the bucket root {root}")
        if file != MANIFEST_NAME:
            observed[file] = _hash_file(path) if path.is_file() else None
    check_files(manifest, observed)
    return version_dir.resolve() if root is not None else version_dir


def _delete_dir_version(path: Path) -> None:
    """Remove a version directory, manifest first, so no reader sees a manifest without its files."""
    try:
        (path / MANIFEST_NAME).unlink()
        _fsync_dir(path)
    except FileNotFoundError:
        pass
    if path.exists():
        shutil.rmtree(path)
