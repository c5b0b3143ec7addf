"""What a bucket backend must do, and how every backend retries.

A bucket holds *committed directories* (adapter versions, trainer checkpoints, and whatever is published
next) plus a few small run files. A committed directory is flat: its files, and a `manifest.json` listing
each file's size and sha256, written last. The rule every backend keeps: a reader that sees the manifest
sees every file it lists, and a directory without one does not exist for anyone. `Bucket` decides the
names and what a manifest says; a `Store` only moves bytes under that rule. So the directory and s3
backends (`directory.py`, `s3.py`) each implement these few methods, in the one file that knows their
medium, instead of one class branching on the medium at every operation.

Paths handed to a store (`rel`) are '/'-separated, relative to its root, and made by `Bucket` from
names it has checked, so a store never climbs out of its root.

Besides those, a store offers conditional writes of one small file (`create`, `read_tagged`, `replace`,
`remove`): what a run's lease (`lease.py`) is built on, so that of two writers exactly one wins.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rl_cluster.core.retry import RetriesExhausted, RetryPolicy
from rl_cluster.errors import AdapterError, BucketUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

Digests = Mapping[str, tuple[int, str]]  # file name -> (size, sha256)
Manifest = dict[str, Any]


class Conflict(Exception):
    """A conditional write or delete found the file changed (or gone) since it was read: someone else
    wrote it. Definite, so never retried."""


# Errors that say something definite about the request, not about reachability: retrying cannot help.
_DEFINITIVE = (
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    AdapterError,
    Conflict,
    ValueError,
    TypeError,
)


def _transient(e: Exception) -> bool:
    """Connection refused, timeouts, 5xx, EIO on a mount: maybe transient, so worth another try."""
    return not isinstance(e, _DEFINITIVE)


def retrying(uri: str, policy: RetryPolicy, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs), retrying errors that may be transient (network, I/O), so that a bucket that
    stays unreachable surfaces as one BucketUnavailable naming the URI and the last error, instead of a
    hang or a bare network error."""

    def warn(e: Exception, attempt: int, delay: float) -> None:
        log.warning(
            "%s: %s: %s (attempt %d/%s, retrying in %.2fs)", uri, what, e, attempt, policy.attempts, delay
        )

    try:
        return policy.call(functools.partial(fn, *args, **kwargs), retryable=_transient, on_retry=warn)
    except RetriesExhausted as e:
        raise BucketUnavailable(
            f"bucket {uri} unreachable: {what} failed {e.attempts} times in {e.elapsed_s:.1f}s; "
            f"last error: {type(e.last).__name__}: {e.last}"
        ) from e.last


class Store(ABC):
    """One bucket medium. Every method that reaches the medium retries under `policy`."""

    def __init__(self, uri: str, policy: RetryPolicy):
        self.uri = uri  # the root, as `Bucket.uri` reports it
        self.policy = policy

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def _retry(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return retrying(self.uri, self.policy, what, fn, *args, **kwargs)

    @abstractmethod
    def uri_of(self, rel: str) -> str:
        """The URI of a path under the root (what callers are handed and hand back)."""

    @abstractmethod
    def locate(self, uri: str, what: str) -> list[str]:
        """The path segments, relative to the root, of a URI a caller handed in; AdapterRejected when it
        does not lie inside the root. `what` names the thing in messages ("an adapter")."""

    @abstractmethod
    def publish(self, rel: str, files: Sequence[Path], manifest_for: Callable[[Digests], bytes]) -> None:
        """Commit `files` as the directory `rel`: the files, then `manifest_for(their digests)` as its
        manifest, last. The digests are of the bytes actually written, which is why the manifest comes
        from a function. FileExistsError when `rel` is committed already; after any failure, nothing a
        reader would take is left."""

    @abstractmethod
    def committed(self, parent: str) -> list[str]:
        """Names of the committed directories (those with a manifest) right under `parent`."""

    @abstractmethod
    def fetch(self, rel: str, manifest: Manifest, cache: Path, copy: bool = False) -> Path:
        """A local directory holding the committed directory `rel`, every file checked against
        `manifest` (AdapterRejected names the first that differs). A remote store copies into
        `cache/<rel>`; a directory store verifies in place, or with `copy` copies too: what is checked
        is then the copy, which nobody else writes, and no longer the bucket's files, which a writer to
        the bucket could swap after the check."""

    @abstractmethod
    def delete(self, rel: str) -> None:
        """Remove a committed directory, manifest first, so no reader sees a manifest whose files are
        going; an absent one is no error."""

    @abstractmethod
    def move(self, rel: str, new_rel: str) -> None:
        """Move a committed directory to `new_rel` (which must not exist), manifest and all."""

    @abstractmethod
    def read(self, rel: str) -> bytes:
        """A small file's bytes; FileNotFoundError when there is none."""

    @abstractmethod
    def write(self, rel: str, data: bytes) -> None:
        """Write a small file atomically: readers see the old or the new content, never half."""

    # ---------------------------------------------------------------- conditional writes (the run lease)

    @abstractmethod
    def create(self, rel: str, data: bytes) -> str:
        """Write a small file only where there is none, atomically (of two writers exactly one wins);
        returns its tag. FileExistsError when there is one."""

    @abstractmethod
    def read_tagged(self, rel: str) -> tuple[bytes, str]:
        """A small file's bytes and its tag, which names those bytes (an ETag, a digest): another write
        of other bytes changes it. FileNotFoundError when there is none."""

    @abstractmethod
    def replace(self, rel: str, data: bytes, tag: str) -> str:
        """Replace a small file only while it is still the one `tag` names; returns the new tag.
        Conflict when it changed or is gone."""

    @abstractmethod
    def remove(self, rel: str, tag: str) -> None:
        """Delete a small file only while it is still the one `tag` names; Conflict when it changed.
        An absent file is no error."""
