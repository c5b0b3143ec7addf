"""A run lease's record (`lease.json`): who holds it, since when, until when, and where its pid means
something; the line a refused driver prints. Pure: no store, no clock of its own (rl_cluster/bucket/lease.py
holds the protocol)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import secrets
import socket
from dataclasses import dataclass, replace
from pathlib import Path


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
