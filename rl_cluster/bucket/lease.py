"""A run's lease: `<bucket>/<run>/lease.json`, so that one driver at a time writes a run.

Two drivers started with the same run_name would both publish versions and checkpoints under it, and
one's retention would delete the other's versions; the checks a run makes before it starts (a fresh
name, something to resume) are check-then-act, and safe only while nobody else can act. So a driver
takes the run's lease first, before anything expensive starts, and holds it until the run has ended:

- acquire: create the file exclusively (of two drivers exactly one wins), or take over a lease whose
  holder stopped renewing it TTL ago (a conditional replace of the record that was read: of two takers
  one wins). A live lease is refused with one line naming its holder (LeaseHeld).
- renew, every TTL/3 on a daemon thread: a conditional replace of the record this process last wrote, so
  a driver whose lease was taken over finds out at its next renewal (LeaseLost) instead of writing on.
- release, however the run ends: a conditional delete of that record. A driver killed before it
  releases (SIGKILL) leaves a lease that expires TTL after its last renewal, or at once for a driver
  on the same host, boot and pid namespace, which can see that the holder's process is gone.

Expiry compares the record's `expires` with the reader's wall clock: hosts' clocks must agree to well
within the TTL. The record says who holds the lease (host, pid, and an id drawn per acquisition, so a
successor on the same host and pid is still someone else) and since when.

The record and the messages are pure; IO goes through a Store's conditional writes (store.py says what
they promise, directory.py and s3.py how each medium keeps it).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from rl_cluster.bucket.store import Conflict, Store
from rl_cluster.errors import LeaseHeld, LeaseLost

log = logging.getLogger(__name__)

LEASE_TTL_S = 60.0  # long enough to ride out a bucket's hiccup, short enough to wait for after a crash
# Rounds of create / read / take over before giving up on a lease that keeps changing under us.
_ATTEMPTS = 5
_UNREADABLE_WAIT_S = 0.2  # a file being created on a mount may be empty for a moment


@dataclass(frozen=True)
class LeaseRecord:
    """What `lease.json` says: who holds the run's lease, since when, and until when unless renewed."""

    host: str
    pid: int
    id: str  # random per acquisition: tells this holder from a successor on the same host and pid
    since: float  # UTC epoch seconds
    expires: float
    # Where the pid means something (empty when not known): the host's boot, the pid namespace, and the
    # process's start time in clock ticks since boot (a pid taken again by another process differs).
    boot: str = ""
    pidns: str = ""
    started: int = 0

    def is_live(self, now: float) -> bool:
        return now < self.expires

    def renewed(self, now: float, ttl_s: float) -> LeaseRecord:
        return replace(self, expires=now + ttl_s)

    @property
    def holder(self) -> str:
        return f"host {self.host}, pid {self.pid}"

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "holder": {"host": self.host, "pid": self.pid, "id": self.id, **self._process()},
                "since": iso(self.since),
                "expires": iso(self.expires),
            },
            indent=2,
        ).encode()

    def _process(self) -> dict:
        known = {"boot": self.boot, "pidns": self.pidns, "started": self.started}
        return {k: v for k, v in known.items() if v}

    @classmethod
    def parse(cls, data: bytes, where: str) -> LeaseRecord:
        """The record in `data`; ValueError naming `where` when it is not one."""
        try:
            raw = json.loads(data)
            holder = raw["holder"]
            record = cls(
                host=str(holder["host"]),
                pid=int(holder["pid"]),
                id=str(holder["id"]),
                since=_epoch(raw["since"]),
                expires=_epoch(raw["expires"]),
                boot=str(holder.get("boot", "")),
                pidns=str(holder.get("pidns", "")),
                started=int(holder.get("started", 0)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: not a lease record ({type(e).__name__}: {e})") from None
        if not record.id:
            raise ValueError(f"{where}: not a lease record (empty holder id)")
        return record


def new_record(now: float, ttl_s: float, host: str | None = None, pid: int | None = None) -> LeaseRecord:
    """A lease for this process (or the given host and pid), from `now` for `ttl_s`. On this host the
    record also says where its pid means something (`process_identity`)."""
    pid = os.getpid() if pid is None else pid
    boot, pidns, started = process_identity(pid) if host is None else ("", "", 0)
    return LeaseRecord(
        host=host or socket.gethostname(),
        pid=pid,
        id=secrets.token_hex(8),
        since=now,
        expires=now + ttl_s,
        boot=boot,
        pidns=pidns,
        started=started,
    )


def process_identity(pid: int) -> tuple[str, str, int]:
    """This host's boot id, this process's pid namespace, and `pid`'s start time (clock ticks since boot);
    each empty (or 0) where /proc does not say."""

    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return ""

    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    stat = read(f"/proc/{pid}/stat")
    # Field 22 (starttime), counted after the command's closing parenthesis: the command may hold spaces.
    fields = stat.rpartition(")")[2].split()
    started = int(fields[19]) if len(fields) > 19 else 0
    return read("/proc/sys/kernel/random/boot_id"), pidns, started


def held_message(run_name: str, uri: str, record: LeaseRecord, ttl_s: float) -> str:
    """The one line a driver refused for a live lease prints: who holds it, since when, what to do."""
    return (
        f"run {run_name!r} is in use by another driver: {uri} is held by {record.holder} since "
        f"{iso(record.since)} (expires {iso(record.expires)} unless renewed). Wait for that run to end, "
        f"pick another run_name, or --resume {run_name} once its lease has expired ({ttl_s:.0f} s after "
        "its driver stopped)."
    )


def holder_gone(record: LeaseRecord) -> bool:
    """The holder ran on this host, in this boot and this pid namespace, and its process is gone (or its
    pid belongs to a process started later): a driver killed before it could release (the usual crash, and
    `--resume` is resubmitted to the same head node), so the TTL need not be waited out. Anything this
    process cannot see counts as alive, and the lease then expires: a holder on another host, or in
    another pid namespace of the same hostname (host-networked containers share the hostname, not the
    pids), or a record that does not say where its pid means something."""
    boot, pidns, _ = process_identity(os.getpid())
    if (
        (record.host, record.boot, record.pidns) != (socket.gethostname(), boot, pidns)
        or not boot
        or not pidns
    ):
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, under another user
        return False
    started = process_identity(record.pid)[2]
    return bool(record.started and started and started != record.started)


def iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _epoch(text: str) -> float:
    when = _dt.datetime.fromisoformat(text)
    if when.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return when.timestamp()


class RunLease:
    """One run's lease as this process holds it: `acquire`, `start_renewing`, and `release` at the end."""

    def __init__(
        self,
        store: Store,
        run_name: str,
        rel: str,
        *,
        ttl_s: float = LEASE_TTL_S,
        clock: Callable[[], float] = time.time,
    ):
        self.store, self.run_name, self.rel = store, run_name, rel
        self.uri = store.uri_of(rel)
        self.ttl_s = ttl_s
        self.clock = clock
        self.record: LeaseRecord | None = None  # while held: what this process last wrote
        self.lost: str | None = None  # why the renewer gave up, once it has
        self._tag = ""  # the store's tag of `record`: conditional writes name it
        self._lock = threading.Lock()  # the renewer and release never interleave
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- acquire

    def acquire(self) -> LeaseRecord:
        """Take the lease: create it, or take over an expired one. LeaseHeld while another's is live."""
        mine = new_record(self.clock(), self.ttl_s)
        for _ in range(_ATTEMPTS):
            try:
                return self._hold(mine, self.store.create(self.rel, mine.to_json()))
            except FileExistsError:
                pass
            try:
                current, tag = self._read()
            except FileNotFoundError:
                continue  # released between our create and our read: create again
            if current.id == mine.id:
                # Our create (or takeover) went through, its answer was lost, and the retry found the file.
                return self._hold(current, tag)
            gone = holder_gone(current)
            if current.is_live(self.clock()) and not gone:
                raise LeaseHeld(held_message(self.run_name, self.uri, current, self.ttl_s))
            log.warning(
                "%s: taking over the lease %s held by %s, %s",
                *(self.run_name, self.uri, current.holder),
                "whose process is gone" if gone else f"expired at {iso(current.expires)}",
            )
            mine = new_record(self.clock(), self.ttl_s)
            try:
                return self._hold(mine, self.store.replace(self.rel, mine.to_json(), tag))
            except Conflict:
                continue  # another driver took it over first (or its holder renewed it late): look again
        raise LeaseHeld(
            f"run {self.run_name!r}: {self.uri} changed {_ATTEMPTS} times while this driver tried to take "
            "it; another driver is starting under the same run_name. Wait, or pick another run_name."
        )

    def _hold(self, record: LeaseRecord, tag: str) -> LeaseRecord:
        self.record, self._tag, self.lost = record, tag, None
        return record

    def _read(self) -> tuple[LeaseRecord, str]:
        """The record in the bucket and its tag; FileNotFoundError when there is none. A file that does
        not parse is read again a few times (a mount may show a file being created empty for a moment);
        then LeaseHeld, since only a person can tell whether a run is still behind it."""
        for _ in range(3):
            data, tag = self.store.read_tagged(self.rel)
            try:
                return LeaseRecord.parse(data, self.uri), tag
            except ValueError as e:
                error = e
            time.sleep(_UNREADABLE_WAIT_S)
        raise LeaseHeld(
            f"run {self.run_name!r}: {error}. If no driver is running {self.run_name!r}, delete {self.uri} "
            "and start again."
        )

    # ---------------------------------------------------------------- renew

    def renew(self) -> None:
        """Extend the lease by a TTL from now. LeaseLost when it is no longer this process's."""
        with self._lock:
            if self.record is None:
                raise LeaseLost(f"{self.uri}: not held by this driver")
            mine = self.record.renewed(self.clock(), self.ttl_s)
            for _ in range(2):
                try:
                    self._tag = self.store.replace(self.rel, mine.to_json(), self._tag)
                    self.record = mine
                    return
                except Conflict:
                    pass
                # Changed since our last write: another holder's now, unless the change was ours (a
                # retried write whose first answer was lost); then renew from what is there.
                try:
                    current, tag = self._read()
                except FileNotFoundError:
                    raise LeaseLost(f"{self.uri} was deleted while this driver held it") from None
                if current.id != mine.id:
                    # Not ours: its tag must not be kept, or release() would delete the successor's lease.
                    raise LeaseLost(
                        f"{self.uri} is now held by {current.holder} (since {iso(current.since)}): this "
                        f"driver's lease expired at {iso(self.record.expires)} and was taken over"
                    )
                self._tag = tag
            raise LeaseLost(f"{self.uri} kept changing while this driver renewed it")

    def start_renewing(self, on_lost: Callable[[str], None]) -> None:
        """Renew every TTL/3 on a daemon thread until `release`; when the lease is lost (taken over, or
        not renewed before it expired), call `on_lost(why)` once and stop."""

        def renew_until_released() -> None:
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    self.renew()
                    continue
                except LeaseLost as e:
                    why = str(e)
                except Exception as e:  # the bucket unreachable: fine while the lease has time left
                    expires = self.record.expires if self.record else 0.0
                    if self.clock() < expires:
                        log.warning("%s: could not renew %s (%s); retrying", self.run_name, self.uri, e)
                        continue
                    why = f"{self.uri} could not be renewed before it expired: {type(e).__name__}: {e}"
                if self._stop.is_set():
                    return  # released meanwhile: nothing was lost
                self.lost = why
                log.error("%s: lost the run's lease: %s", self.run_name, why)
                on_lost(why)
                return

        self._stop.clear()
        self._thread = threading.Thread(target=renew_until_released, name="run-lease", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- release

    def release(self) -> None:
        """Stop renewing and delete the lease while it is still this process's. Never raises: a lease
        that could not be deleted expires TTL after its last renewal."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a renewal in flight finishes under the lock below
        with self._lock:
            record, self.record = self.record, None
            if record is None:
                return
            try:
                self.store.remove(self.rel, self._tag)
            except Conflict:
                try:
                    current, tag = self._read()
                    if current.id == record.id:  # ours after all (a retried write): delete that
                        self.store.remove(self.rel, tag)
                    else:
                        log.warning(
                            "%s: %s is held by %s now; left alone", self.run_name, self.uri, current.holder
                        )
                except FileNotFoundError:
                    pass
                except Exception as e:
                    self._left(e)
            except Exception as e:
                self._left(e)

    def _left(self, e: Exception) -> None:
        log.warning(
            "%s: could not delete %s (%s: %s); it expires %.0f s after its last renewal",
            *(self.run_name, self.uri, type(e).__name__, e, self.ttl_s),
        )
