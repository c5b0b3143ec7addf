"""The run lease's pure part: the record, its expiry, the refusal line. The protocol against real
directories and a real S3 API is in tests/integration/test_lease.py."""

import json

import pytest

from rl_cluster.bucket.lease import LeaseRecord, held_message, iso, new_record
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
    import subprocess
    import sys

    code = (
        "import sys, rl_cluster.bucket.lease; "
        "print(sorted(m for m in ('ray', 's3fs', 'botocore', 'aiohttp', 'fsspec') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
