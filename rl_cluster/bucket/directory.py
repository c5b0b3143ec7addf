"""The directory backend: a bucket that is a directory every node sees at the same path (a local
directory on one machine; on a cluster a mounted cloud bucket).

A directory is committed by writing its files and manifest into a dot-prefixed temporary sibling
(listings skip it), fsyncing, and renaming it into place in one step: a reader sees all of it or none.
Readers verify in place, since the bucket is already a local path vLLM can read; the path must resolve
inside the bucket root (vLLM follows symlinks, so a link out of the bucket would load something else).

The run lease's conditional writes: `create` writes a private file and hard-links it into place (link
fails when the name exists, and the file appears whole); a POSIX directory has no compare-and-swap, so
every conditional write of a file holds an exclusive `flock` on `.<name>.lock` beside it, and `replace`
compares and then renames the new bytes over the old: the file is never absent, so a newcomer's
`create` cannot land between (a rename-aside swap left that window: a newcomer took a live lease). On a
mount without locks (gcsfuse) `replace` falls back to the rename-aside swap, with a warning. A file's
tag is the sha256 of its bytes.

The s3 backend's local cache is a directory store too (same layout, same commit), which is why `commit`
takes a function that fills the temporary directory rather than source files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from rl_cluster.bucket.store import Conflict, Digests, Manifest, Store
from rl_cluster.core.manifest import MANIFEST_NAME, check_files, manifest_to_json, sha256_of
from rl_cluster.core.retry import RetryPolicy
from rl_cluster.errors import AdapterRejected

_CHUNK = 1 << 20
log = logging.getLogger(__name__)


class DirectoryStore(Store):
    def __init__(self, uri: str, policy: RetryPolicy):
        if "://" in uri and not uri.startswith("file://"):  # gs://b would be a directory named 'gs:'
            raise ValueError(f"bucket {uri!r}: a bucket is a directory (or file://...) or s3://bucket/prefix")
        # Not resolved: the root is reported as given; checks resolve it at the time they run.
        self.root = Path(uri.removeprefix("file://")).expanduser().absolute()
        super().__init__(str(self.root), policy)

    def uri_of(self, rel: str) -> str:
        return str(self.root / rel)

    def locate(self, uri: str, what: str) -> list[str]:
        path = Path(uri.removeprefix("file://")).expanduser()
        if ".." in path.parts:
            raise AdapterRejected(f"{uri}: '..' in {what} path is refused")
        root = self.root.resolve()
        path = path.absolute()
        resolved = path.resolve()  # follows symlinks: a link pointing out of the bucket is caught here
        parent = path.parent.resolve()
        if not resolved.is_relative_to(root) or not parent.is_relative_to(root):
            raise AdapterRejected(f"{uri}: resolves to {resolved}, outside the bucket root {root}")
        # The name as given (not as resolved): a link `p-v3 -> p-v2` must fail the manifest name check.
        return [*parent.relative_to(root).parts, path.name]

    def publish(self, rel: str, files: Sequence[Path], manifest_for: Callable[[Digests], bytes]) -> None:
        def fill(tmp: Path) -> bytes:
            return manifest_for({src.name: _copy_hashed(src, tmp / src.name) for src in files})

        self._retry(f"publish {self.uri_of(rel)}", self.commit, rel, fill)

    def commit(self, rel: str, fill: Callable[[Path], bytes]) -> Path:
        """Commit the directory `rel`: `fill(tmp)` writes the files into a temporary directory and returns
        the manifest, which is written last; then one rename. FileExistsError (or, when another writer
        wins the race, OSError from the rename) when `rel` is there already."""
        final = self.root / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            raise FileExistsError(f"{final} is already published")
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"  # dot: listings skip it
        tmp.mkdir()
        try:
            write_synced(tmp / MANIFEST_NAME, fill(tmp))
            _fsync_dir(tmp)
            os.rename(tmp, final)  # the commit: the whole directory appears at once
            _fsync_dir(final.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; a leftover after a failure
        return final

    def committed(self, parent: str) -> list[str]:
        return self._retry(f"list {self.uri_of(parent)}", _committed_names, self.root / parent)

    def is_committed(self, rel: str) -> bool:
        return (self.root / rel / MANIFEST_NAME).is_file()

    def fetch(self, rel: str, manifest: Manifest, cache: Path, copy: bool = False) -> Path:
        if copy:
            return verified_copy(rel, manifest, cache, lambda tmp: self._copy(rel, manifest, tmp))
        # In place: the bucket is already a local path, so `cache` is not needed.
        return self._retry(f"verify {self.uri_of(rel)}", self._verify, self.root / rel, manifest)

    def _copy(self, rel: str, manifest: Manifest, tmp: Path) -> bytes:
        """Copy the files `manifest` lists into `tmp`, hashing the bytes as they are written (the copy is
        what gets checked), and return the manifest to commit the copy with."""
        root, directory = self.root.resolve(), self.root / rel
        for file in [MANIFEST_NAME, *manifest["files"]]:  # as in place: nothing linked out of the bucket
            if not (directory / file).resolve().is_relative_to(root):
                raise AdapterRejected(
                    f"{file}: resolves to {(directory / file).resolve()}, outside the bucket root {root}"
                )
        observed: dict[str, tuple[int, str] | None] = {}
        for file in manifest["files"]:
            path = directory / file
            observed[file] = (
                self._retry(f"copy {self.uri_of(rel)}/{file}", _copy_hashed, path, tmp / file)
                if path.is_file()
                else None
            )
        check_files(manifest, observed)
        return manifest_to_json(manifest).encode()

    def _verify(self, directory: Path, manifest: Manifest) -> Path:
        root = self.root.resolve()
        observed: dict[str, tuple[int, str] | None] = {}
        for file in [MANIFEST_NAME, *manifest["files"]]:
            path = directory / file
            # vLLM follows symlinks, so a file linked out of the bucket would be loaded from elsewhere.
            if not path.resolve().is_relative_to(root):
                raise AdapterRejected(f"{file}: resolves to {path.resolve()}, outside the bucket root {root}")
            if file != MANIFEST_NAME:
                observed[file] = _hash_file(path) if path.is_file() else None
        check_files(manifest, observed)
        return directory.resolve()

    def delete(self, rel: str) -> None:
        self._retry(f"delete {self.uri_of(rel)}", _remove_committed, self.root / rel)

    def move(self, rel: str, new_rel: str) -> None:
        (self.root / new_rel).parent.mkdir(parents=True, exist_ok=True)
        # One rename: readers see the directory at the old place or not at all.
        self._retry(f"move {self.uri_of(rel)}", os.rename, self.root / rel, self.root / new_rel)

    def read(self, rel: str) -> bytes:
        return self._retry(f"read {self.uri_of(rel)}", (self.root / rel).read_bytes)

    def write(self, rel: str, data: bytes) -> None:
        self._retry(f"write {self.uri_of(rel)}", _atomic_write, self.root / rel, data)

    def create(self, rel: str, data: bytes) -> str:
        return self._retry(f"create {self.uri_of(rel)}", _create_locked, self.root / rel, data)

    def read_tagged(self, rel: str) -> tuple[bytes, str]:
        data = self.read(rel)
        return data, _tag(data)

    def replace(self, rel: str, data: bytes, tag: str) -> str:
        return self._retry(f"replace {self.uri_of(rel)}", _swap, self.root / rel, tag, data)

    def remove(self, rel: str, tag: str) -> None:
        self._retry(f"remove {self.uri_of(rel)}", _swap, self.root / rel, tag, None)


def verified_copy(rel: str, manifest: Manifest, cache: Path, fill: Callable[[Path], bytes]) -> Path:
    """`cache/<rel>`, a node-local copy of a committed directory: made by `fill(tmp)` (which checks what it
    wrote and returns the manifest to commit it with), or, when a copy is there already, that one checked
    again (a bad one is replaced)."""
    local = DirectoryStore(str(cache), RetryPolicy(attempts=1))  # a local disk: nothing to retry
    if local.is_committed(rel):
        try:
            return local.fetch(rel, manifest, cache)
        except AdapterRejected as e:
            log.warning("cached copy %s is bad (%s); copying it again", local.uri_of(rel), e)
            local.delete(rel)
    try:
        local.commit(rel, fill)
    except OSError:
        if not local.is_committed(rel):
            raise
        # Another process on this node copied it first; its copy passed the same checks.
    return Path(local.uri_of(rel)).resolve()


def write_synced(path: Path, data: bytes) -> None:
    """Write a file and fsync it: a rename that commits it must not outlive its contents in a crash."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _tag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _create_exclusive(path: Path, data: bytes) -> str:
    """Create a file that must not exist (FileExistsError), with `data` synced; returns its tag.

    The bytes are written to a private name first and hard-linked into place: `link` fails when the
    name exists, and the file appears whole. An `O_EXCL` create shows an empty file until it is written,
    and a concurrent `_swap` would move that empty file aside, find it foreign and put an empty one back,
    while the creator wrote its record into the inode it had moved away (two takers of an expired lease
    then left an empty lease file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.new-{uuid.uuid4().hex[:8]}")
    try:
        write_synced(tmp, data)
        os.link(tmp, path)
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
        _create_in_place(path, data, why=e)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return _tag(data)


# What a mount without hard links answers `link` with (gcsfuse and s3fs have none).
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
_said_no_links: set[Path] = set()  # directories warned about: a lease renewal creates every TTL/3


def _create_in_place(path: Path, data: bytes, why: OSError) -> None:
    """`O_CREAT | O_EXCL` and write: the file is empty for a moment, so two drivers taking over one
    expired lease at once can leave an empty record (the next start then names the file to delete)."""
    if path.parent not in _said_no_links:
        _said_no_links.add(path.parent)
        log.warning(
            "%s: this mount has no hard links (%s); creating files in place, which is not atomic against "
            "a concurrent takeover. An s3:// bucket has real conditional writes.",
            *(path.parent, why.strerror),
        )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)  # a half-written file would read as a corrupt one
        raise


# What a mount without advisory locks answers `flock` with.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EBADF}
_said_no_locks: set[Path] = set()


@contextlib.contextmanager
def _exclusive(path: Path):
    """An exclusive flock on `.<name>.lock` beside `path`: one conditional write of the file at a time,
    between processes and between threads (a flock belongs to the open file). Yields whether it is held:
    False on a mount without locks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = True
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
            if path.parent not in _said_no_locks:
                _said_no_locks.add(path.parent)
                log.warning("%s: this mount has no file locks (%s); a lease renewal there is not atomic "
                            "against a newcomer. An s3:// bucket has real conditional writes.",
                            path.parent, e.strerror)  # fmt: skip
            held = False
        yield held
    finally:
        os.close(fd)  # releases the lock


def _create_locked(path: Path, data: bytes) -> str:
    with _exclusive(path):
        return _create_exclusive(path, data)


def _swap(path: Path, tag: str, data: bytes | None) -> str | None:
    """Replace `path` by `data` (delete it when None) only while its bytes are the ones `tag` names: under
    the file's lock, compared and then renamed over, so the file is never absent meanwhile."""
    with _exclusive(path) as held:
        if not held:
            return _swap_aside(path, tag, data)
        try:
            current = path.read_bytes()
        except FileNotFoundError:
            if data is None:
                return None
            raise Conflict(f"{path} is gone") from None
        if _tag(current) != tag:
            raise Conflict(f"{path} changed since it was read")
        if data is None:
            path.unlink()
            _fsync_dir(path.parent)
            return None
        _atomic_write(path, data)
        return _tag(data)


def _swap_aside(path: Path, tag: str, data: bytes | None) -> str | None:
    """`_swap` where there are no locks: the file is moved aside (of two swappers one gets it), checked,
    and created again exclusively; a newcomer's create can land while it is aside."""
    aside = path.with_name(f".{path.name}.swap-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)  # atomic: of two swappers, one moves the file and the other finds none
    except FileNotFoundError:
        if data is None:
            return None
        raise Conflict(f"{path} is gone") from None
    try:
        current = aside.read_bytes()
        if _tag(current) != tag:
            # Someone else's file: put it back, unless a third writer created one meanwhile.
            with contextlib.suppress(FileExistsError):
                _create_exclusive(path, current)
            raise Conflict(f"{path} changed since it was read")
        if data is None:
            return None
        try:
            return _create_exclusive(path, data)
        except FileExistsError:
            raise Conflict(f"{path} was created by another writer meanwhile") from None
    finally:
        aside.unlink(missing_ok=True)


def _copy_hashed(src: Path, dest: Path) -> tuple[int, str]:
    """Copy a file and return (size, sha256) of the bytes actually written: the manifest then describes
    the copy even if the source changes meanwhile."""
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


def _committed_names(directory: Path) -> list[str]:
    """Subdirectories of `directory` that have a manifest; temporaries (dot names) have one for a moment
    before their rename and are not committed."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    return sorted(
        entry.name
        for entry in entries
        if not entry.name.startswith(".") and os.path.isfile(os.path.join(entry.path, MANIFEST_NAME))
    )


def _remove_committed(path: Path) -> None:
    """Remove a committed directory, manifest first, so no reader sees a manifest without its files."""
    try:
        (path / MANIFEST_NAME).unlink()
        _fsync_dir(path)
    except FileNotFoundError:
        pass
    if path.exists():
        shutil.rmtree(path)
