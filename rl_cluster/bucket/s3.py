"""The s3 backend: a bucket at `s3://bucket/prefix` on any S3-compatible store, reached with s3fs.

An S3 PUT is atomic, so a directory is committed by uploading its files and then its manifest: the
manifest's presence is the commit. Readers cannot hand vLLM an s3:// path, so `fetch` copies a directory
into a local cache (`cache/<rel>`, the bucket's own layout) that is a directory store: the download is
committed there the same way, and a cached copy is verified again before it is used.

The run lease's conditional writes are S3's own: a PUT with `If-None-Match: *` creates, one with
`If-Match: <ETag>` replaces, a DELETE with `If-Match` removes; a file's tag is its ETag. A store that
ignores those headers (some S3-compatible ones) cannot keep two drivers of one run apart.

One retry loop (the policy's) wraps each request; s3fs's and botocore's own retries are off, so that
"bounded" means what it says.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rl_cluster.bucket.directory import verified_copy, write_synced
from rl_cluster.bucket.store import Conflict, Digests, Manifest, Store, retrying
from rl_cluster.core.manifest import MANIFEST_NAME, check_files, manifest_to_json, sha256_of
from rl_cluster.core.retry import RetryPolicy
from rl_cluster.errors import AdapterRejected

log = logging.getLogger(__name__)


class S3Store(Store):
    def __init__(self, uri: str, policy: RetryPolicy, endpoint_url: str | None, timeout_s: float):
        self.root = uri.removeprefix("s3://").strip("/")  # `bucket/prefix`, as s3fs names paths
        if not self.root or ".." in self.root.split("/"):
            raise ValueError(f"bucket uri {uri!r} must look like s3://bucket[/prefix]")
        super().__init__(f"s3://{self.root}", policy)
        self.endpoint_url = endpoint_url
        self.timeout_s = timeout_s
        self._fs: Any = None  # s3fs.S3FileSystem, made on first use (and not pickled: see __getstate__)

    def __getstate__(self) -> dict[str, Any]:
        # Buckets travel to Ray actors; each process makes its own S3 client (they hold event loops).
        return {**self.__dict__, "_fs": None}

    @property
    def fs(self) -> Any:
        """The s3fs filesystem."""
        if self._fs is None:
            import s3fs  # only s3 users pay for the import

            client_kwargs = {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"}
            self._fs = s3fs.S3FileSystem(
                client_kwargs=client_kwargs if self.endpoint_url else {},
                config_kwargs={
                    "connect_timeout": self.timeout_s,
                    "read_timeout": self.timeout_s,
                    "retries": {"mode": "standard", "total_max_attempts": 1},
                },
                use_listings_cache=False,  # a cached listing would hide new versions
                skip_instance_cache=True,
            )
            self._fs.retries = 1
        return self._fs

    def _retry(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return retrying(self.uri, self.policy, what, self._credentials_checked(fn), *args, **kwargs)

    def _credentials_checked(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, with missing credentials as a PermissionError (never retried: they cannot appear by
        themselves) that says where they go."""
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (NoCredentialsError, PartialCredentialsError) as e:
                raise PermissionError(
                    f"no S3 credentials for {self.uri} ({e}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                    "(or AWS_PROFILE) where the driver runs and on every node"
                ) from e

        return call

    def _key(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def uri_of(self, rel: str) -> str:
        return f"s3://{self._key(rel)}"

    def locate(self, uri: str, what: str) -> list[str]:
        if not uri.startswith("s3://"):
            raise AdapterRejected(f"{uri}: not an s3:// URI, but the bucket is {self.uri}")
        parts = uri.removeprefix("s3://").rstrip("/").split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise AdapterRejected(f"{uri}: empty, '.' or '..' path segments are refused")
        root = self.root.split("/")
        if parts[: len(root)] != root:
            raise AdapterRejected(f"{uri}: outside the bucket root {self.uri}")
        return parts[len(root) :]

    def _exists(self, key: str) -> bool:
        """Whether an object exists: one HEAD (s3fs's `exists`/`info` also list the prefix on a miss)."""
        bucket, name, _ = self.fs.split_path(key)
        try:
            self.fs.call_s3("head_object", Bucket=bucket, Key=name)
        except FileNotFoundError:
            return False
        return True

    def publish(self, rel: str, files: Sequence[Path], manifest_for: Callable[[Digests], bytes]) -> None:
        key = self._key(rel)
        manifest_key = f"{key}/{MANIFEST_NAME}"
        if self._retry(f"check {manifest_key}", self._exists, manifest_key):
            raise FileExistsError(f"{self.uri_of(rel)} is already published")
        try:
            digests = {}
            for src in files:
                data = src.read_bytes()  # one read: what is hashed is exactly what is uploaded
                digests[src.name] = sha256_of([data])
                self._retry(f"upload {key}/{src.name}", self.fs.pipe_file, f"{key}/{src.name}", data)
            self._commit(rel, manifest_key, manifest_for(digests))
        except _CommittedByAnother:
            raise FileExistsError(
                f"{self.uri_of(rel)} was published by another writer while this one uploaded; names are "
                "never reused (two trainers writing one run: see the run's lease)"
            ) from None  # its version: nothing of it is tidied up here
        except BaseException:
            # Files without a manifest are invisible to readers already; tidy up if the bucket lets us.
            try:
                self.delete(rel)
            except Exception as e:
                log.warning("could not remove the unfinished %s: %s", self.uri_of(rel), e)
            raise

    def _commit(self, rel: str, manifest_key: str, manifest: bytes) -> None:
        """The manifest's upload, exactly once: a conditional PUT (If-None-Match), so that of two writers
        of one name (the HEAD check before is check-then-act) one commits and the other learns it. A
        retry whose first attempt landed finds its own bytes there: committed."""
        try:
            self._retry(f"commit {manifest_key}", self._put, manifest_key, manifest, IfNoneMatch="*")
        except FileExistsError:
            theirs, _ = self._retry(f"read {manifest_key}", self._get_tagged, manifest_key)
            if theirs != manifest:
                raise _CommittedByAnother() from None

    def committed(self, parent: str) -> list[str]:
        prefix = self._key(parent)
        try:
            keys = self._retry(f"list {prefix}", self.fs.find, prefix)
        except FileNotFoundError:
            return []
        names = set()
        for key in keys:
            parts = key[len(prefix) + 1 :].split("/")
            if len(parts) == 2 and parts[1] == MANIFEST_NAME:
                names.add(parts[0])
        return sorted(names)

    def fetch(self, rel: str, manifest: Manifest, cache: Path, copy: bool = False) -> Path:
        return verified_copy(rel, manifest, cache, lambda tmp: self._download(rel, manifest, tmp))

    def _download(self, rel: str, manifest: Manifest, tmp: Path) -> bytes:
        """Download the files `manifest` lists into `tmp`, check them, and return the manifest to commit
        the copy with."""
        key = self._key(rel)
        observed: dict[str, tuple[int, str] | None] = {}
        for file in manifest["files"]:
            try:
                data = self._retry(f"download {key}/{file}", self.fs.cat_file, f"{key}/{file}")
            except FileNotFoundError:
                observed[file] = None
                continue
            write_synced(tmp / file, data)
            observed[file] = sha256_of([data])
        check_files(manifest, observed)
        return manifest_to_json(manifest).encode()

    def delete(self, rel: str) -> None:
        self._retry(f"delete {self._key(rel)}", self._remove, self._key(rel))

    def _remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{key}/{MANIFEST_NAME}")  # first: the directory stops existing for readers
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(key, recursive=True)

    def move(self, rel: str, new_rel: str) -> None:
        self._retry(f"move {self._key(rel)}", self._move, self._key(rel), self._key(new_rel))

    def _move(self, key: str, new_key: str) -> None:
        # Copy everything, then remove the old place manifest first (delete's order): a reader never sees
        # a manifest at the old place whose files are gone.
        self.fs.copy(key, new_key, recursive=True)
        self._remove(key)

    def read(self, rel: str) -> bytes:
        return self._retry(f"read {self._key(rel)}", self.fs.cat_file, self._key(rel))

    def write(self, rel: str, data: bytes) -> None:
        self._retry(f"write {self._key(rel)}", self.fs.pipe_file, self._key(rel), data)

    def create(self, rel: str, data: bytes) -> str:
        # s3fs turns the 412 of If-None-Match into FileExistsError. A retry after a lost answer gets
        # it too: the lease then reads its own record back (lease.py).
        return self._retry(f"create {self._key(rel)}", self._put, self._key(rel), data, IfNoneMatch="*")

    def read_tagged(self, rel: str) -> tuple[bytes, str]:
        return self._retry(f"read {self._key(rel)}", self._get_tagged, self._key(rel))

    def replace(self, rel: str, data: bytes, tag: str) -> str:
        return self._retry(f"replace {self._key(rel)}", self._put, self._key(rel), data, IfMatch=tag)

    def remove(self, rel: str, tag: str) -> None:
        self._retry(f"remove {self._key(rel)}", self._delete_if, self._key(rel), tag)

    def _put(self, key: str, data: bytes, **condition: str) -> str:
        bucket, name, _ = self.fs.split_path(key)
        try:
            answer = self.fs.call_s3("put_object", Bucket=bucket, Key=name, Body=data, **condition)
        except OSError as e:
            if "IfMatch" in condition and _s3_code(e) in ("PreconditionFailed", "NoSuchKey"):
                raise Conflict(f"s3://{key} changed since it was read") from None
            raise
        return answer["ETag"]

    def _get_tagged(self, key: str) -> tuple[bytes, str]:
        from fsspec.asyn import sync

        bucket, name, _ = self.fs.split_path(key)

        async def get() -> tuple[bytes, str]:
            # One GET for both: a HEAD and a read could see two different writes.
            answer = await self.fs._call_s3("get_object", Bucket=bucket, Key=name)
            try:
                return await answer["Body"].read(), answer["ETag"]
            finally:
                answer["Body"].close()

        return sync(self.fs.loop, get)

    def _delete_if(self, key: str, tag: str) -> None:
        bucket, name, _ = self.fs.split_path(key)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=tag)
        except FileNotFoundError:
            pass
        except OSError as e:
            if _s3_code(e) == "PreconditionFailed":
                raise Conflict(f"s3://{key} changed since it was read") from None
            raise


def _s3_code(error: BaseException) -> str | None:
    """The S3 error code behind an error s3fs translated (it keeps the botocore error as the cause)."""
    response = getattr(error.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code")


class _CommittedByAnother(Exception):
    """A version's manifest was committed by another writer during this one's publish."""
