"""The run lease's pure part: the record, its expiry, the refusal line. The protocol against real
directories and a real S3 API is in tests/integration/test_lease.py."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from rl_cluster.bucket.lease_record import (
    LeaseRecord,
    held_message,
    holder_gone,
    iso,
    new_record,
    process_identity,
)
from rl_cluster.errors import LeaseHeld, RunRefused

NOW = 1_750_000_000.0


def test_a_record_is_live_until_it_expires_and_renewal_moves_only_the_expiry():
    record = new_record(NOW, 60, host="node-3", pid=4121)
    assert record.is_live(NOW) and record.is_live(NOW + 59.9)
    assert not record.is_live(NOW + 60) and not record.is_live(NOW + 3600)
    later = record.renewed(NOW + 20, 60)
    assert (later.id, later.since, later.expires) == (record.id, NOW, NOW + 80)
    assert later.is_live(NOW + 79) and not later.is_live(NOW + 80)


def test_each_acquisition_draws_its_own_id():
    a, b = (new_record(NOW, 60, host="h", pid=1) for _ in range(2))
    assert a.id != b.id and len(a.id) == 16  # same host and pid, still two holders


def test_the_record_round_trips_and_is_readable_json():
    record = new_record(NOW, 60, host="node-3", pid=4121)
    raw = json.loads(record.to_json())
    assert raw == {
        "holder": {"host": "node-3", "pid": 4121, "id": record.id},
        "since": "2025-06-15T15:06:40.000Z",
        "expires": "2025-06-15T15:07:40.000Z",
    }
    back = LeaseRecord.parse(record.to_json(), "x/lease.json")
    assert (back.host, back.pid, back.id) == (record.host, record.pid, record.id)
    assert back.since == pytest.approx(NOW, abs=1e-3) and back.expires == pytest.approx(NOW + 60, abs=1e-3)


@pytest.mark.parametrize(
    "data",
    [
        b"",  # a file being created on a mount, for a moment
        b"{",
        b"[]",
        b'{"since": "2025-06-15T15:06:40Z", "expires": "2025-06-15T15:07:40Z"}',
        b'{"holder": {"host": "h", "pid": 1, "id": ""}, "since": "2025-06-15T15:06:40Z", '
        b'"expires": "2025-06-15T15:07:40Z"}',
        b'{"holder": {"host": "h", "pid": 1, "id": "a"}, "since": "2025-06-15T15:06:40", '
        b'"expires": "2025-06-15T15:07:40"}',  # no time zone: whose clock?
        b'{"holder": {"host": "h", "pid": "one", "id": "a"}, "since": "2025-06-15T15:06:40Z", '
        b'"expires": "2025-06-15T15:07:40Z"}',
    ],
)
def test_what_is_not_a_record_is_refused_naming_where(data):
    with pytest.raises(ValueError, match=r"x/lease\.json: not a lease record"):
        LeaseRecord.parse(data, "x/lease.json")


def test_the_refusal_is_one_line_naming_holder_since_and_what_to_do():
    record = new_record(NOW, 60, host="node-3", pid=4121)
    line = held_message("x", "s3://b/p/x/lease.json", record, 60)
    assert "\n" not in line
    assert "run 'x'" in line and "s3://b/p/x/lease.json" in line
    assert "host node-3, pid 4121" in line and f"since {iso(NOW)}" in line
    assert "Wait" in line and "another run_name" in line and "--resume x" in line


def test_a_held_lease_is_a_refusal_with_exit_status_2():
    assert issubclass(LeaseHeld, RunRefused) and LeaseHeld("m").exit_status == 2


def test_the_lease_module_imports_no_http_or_ray_library():
    code = (
        "import sys, rl_cluster.bucket.lease; "
        "print(sorted(m for m in ('ray', 's3fs', 'botocore', 'aiohttp', 'fsspec') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _mine(pid: int, **changes) -> LeaseRecord:
    """A live record for `pid` on this host, saying where its pid means something, with `changes`."""
    return dataclasses.replace(new_record(NOW, 60, pid=pid), **changes)


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_record_made_here_says_where_its_pid_means_something():
    record = new_record(NOW, 60)
    boot, pidns, started = process_identity(os.getpid())
    assert (record.boot, record.pidns, record.started) == (boot, pidns, started)
    assert boot and pidns.startswith("pid:") and started > 0
    holder = json.loads(record.to_json())["holder"]
    assert (holder["boot"], holder["pidns"], holder["started"]) == (boot, pidns, started)
    assert LeaseRecord.parse(record.to_json(), "x") == record


def test_a_holder_here_is_gone_only_when_its_own_namespace_says_so():
    """Same host, boot and pid namespace: a pid that exited, or that a later process took, is gone;
    the live process itself is not."""
    assert holder_gone(_mine(_exited_pid()))
    assert not holder_gone(_mine(os.getpid()))
    ours = process_identity(os.getpid())[2]
    assert holder_gone(_mine(os.getpid(), started=ours - 1))  # the pid, taken again since


def test_a_holder_whose_pid_this_process_cannot_see_is_alive():
    """A host-networked container shares the hostname, not the pids: a live holder there has a pid
    that does not exist here. It must wait out the TTL, as must a record that does not say where its
    pid means something (written before these fields) or one from another boot."""
    pid = _exited_pid()
    assert not holder_gone(_mine(pid, pidns="pid:[4026530000]"))
    assert not holder_gone(_mine(pid, boot="another-boot"))
    assert not holder_gone(_mine(pid, boot="", pidns="", started=0))
    assert not holder_gone(_mine(pid, host="another-host"))
