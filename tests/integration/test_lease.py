"""The run lease against real directories and a real S3 API (moto's server on loopback, which honours
If-None-Match on PUT and If-Match on PUT and DELETE), and the real entry point refusing a second driver.

Every test here runs on both backends (`bucket`) except the entry point's, which needs no S3.
"""

import errno
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import REPO, S3_ENV, moto_s3

from rl_cluster.bucket import Bucket
from rl_cluster.bucket.layout import lease_rel
from rl_cluster.bucket.lease import RunLease
from rl_cluster.bucket.lease_record import LeaseRecord, iso, new_record
from rl_cluster.bucket.store import Conflict
from rl_cluster.errors import LeaseHeld, LeaseLost

S3_BUCKET = "rl-lease"
RUN = "run1"
FAST_RETRY = dict(attempts=3, retry_base_delay_s=0.01, retry_max_delay_s=0.05)


@pytest.fixture(scope="module")
def s3_endpoint():
    with pytest.MonkeyPatch.context() as mp:
        for key, value in S3_ENV.items():
            mp.setenv(key, value)
        with moto_s3(S3_BUCKET) as endpoint:
            yield endpoint


@pytest.fixture(params=["fs", "s3"])
def new_bucket(request, tmp_path):
    """Makes Bucket objects on one root: each is its own client, as two drivers' would be."""
    if request.param == "fs":
        uri, endpoint = str(tmp_path / "bucket"), None
    else:
        uri, endpoint = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:8]}", request.getfixturevalue("s3_endpoint")
    return lambda: Bucket(uri, endpoint, **FAST_RETRY)


class Clock:
    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def lease_of(bucket: Bucket, clock=time.time, ttl_s: float = 60.0) -> RunLease:
    return RunLease(bucket.store, RUN, lease_rel(RUN), ttl_s=ttl_s, clock=clock)


def stored(bucket: Bucket) -> bytes:
    return bucket.store.read(lease_rel(RUN))


def put_record(bucket: Bucket, record: LeaseRecord) -> None:
    """Another driver's lease, as it would have written it."""
    bucket.store.create(lease_rel(RUN), record.to_json())


def test_of_many_acquirers_exactly_one_wins(new_bucket):
    leases = [lease_of(new_bucket()) for _ in range(8)]
    start = threading.Barrier(len(leases))
    won, refused = [], []

    def take(lease: RunLease) -> None:
        start.wait()
        try:
            won.append(lease.acquire())
        except LeaseHeld as e:
            refused.append(str(e))

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(won) == 1 and len(refused) == 7, (won, refused)
    assert LeaseRecord.parse(stored(new_bucket()), "lease").id == won[0].id
    assert all("is in use by another driver" in line for line in refused)


def test_a_live_lease_is_refused_naming_its_holder_and_left_untouched(new_bucket):
    bucket = new_bucket()
    theirs = new_record(time.time(), 60, host="node-7", pid=4242)
    put_record(bucket, theirs)
    before = stored(bucket)
    with pytest.raises(LeaseHeld) as refused:
        lease_of(new_bucket()).acquire()
    line = str(refused.value)
    assert "\n" not in line and "host node-7, pid 4242" in line and f"since {iso(theirs.since)}" in line
    assert "--resume run1" in line
    assert stored(bucket) == before


def test_a_live_lease_whose_holder_on_this_host_is_gone_is_taken_over_at_once(new_bucket):
    """A SIGKILLed driver's lease, as `--resume` on the same head node finds it: no TTL to wait out."""
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait()
    put_record(new_bucket(), new_record(time.time(), 60, pid=killed.pid))  # this host, renewed just now
    lease = lease_of(new_bucket())
    mine = lease.acquire()
    assert LeaseRecord.parse(stored(new_bucket()), "lease").id == mine.id and mine.pid == os.getpid()
    lease.release()
    # Alive on this host (this test's own process) or on another host: refused, as before.
    put_record(new_bucket(), new_record(time.time(), 60, pid=os.getpid()))
    with pytest.raises(LeaseHeld):
        lease_of(new_bucket()).acquire()


def test_an_expired_lease_is_taken_over_by_exactly_one_of_two(new_bucket):
    put_record(new_bucket(), new_record(time.time() - 120, 60, host="dead", pid=1))
    leases = [lease_of(new_bucket()) for _ in range(2)]
    start = threading.Barrier(2)
    won, refused = [], []

    def take(lease: RunLease) -> None:
        start.wait()
        try:
            won.append(lease.acquire())
        except LeaseHeld as e:
            refused.append(e)

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(won) == 1 and len(refused) == 1, (won, refused)
    now = LeaseRecord.parse(stored(new_bucket()), "lease")
    assert now.id == won[0].id and now.host != "dead" and now.is_live(time.time())


def test_renewal_extends_the_lease_and_fails_for_a_driver_that_was_taken_over(new_bucket):
    clock = Clock()
    old = lease_of(new_bucket(), clock)
    first = old.acquire()
    clock.now += 20
    old.renew()
    assert LeaseRecord.parse(stored(new_bucket()), "lease").expires == pytest.approx(
        first.expires + 20, abs=1e-3
    )

    clock.now += 61  # the old driver stalled past its expiry; a new one takes over
    new = lease_of(new_bucket(), clock)
    successor = new.acquire()
    before = stored(new_bucket())
    with pytest.raises(LeaseLost, match="now held by"):
        old.renew()
    assert stored(new_bucket()) == before  # the non-holder's renewal wrote nothing
    old.release()  # nor does its release delete the successor's lease
    assert LeaseRecord.parse(stored(new_bucket()), "lease").id == successor.id
    new.renew()  # the holder still can


def test_release_deletes_the_lease_so_the_next_driver_takes_it(new_bucket):
    lease = lease_of(new_bucket())
    lease.acquire()
    lease.release()
    with pytest.raises(FileNotFoundError):
        stored(new_bucket())
    lease.release()  # twice is fine
    lease_of(new_bucket()).acquire()


def test_the_renewer_keeps_the_lease_live_and_reports_a_takeover(new_bucket):
    # Renews every 3.3 s; lost with 2.5 s left unrenewed. A 4 s TTL (a renewal given ~1.7 s) was lost once
    # on a busy machine against the S3 server during `make test`.
    lease = lease_of(new_bucket(), ttl_s=10.0)
    mine = lease.acquire()
    lost = threading.Event()
    lease.start_renewing(lambda why: lost.set())
    try:
        time.sleep(10.5)  # longer than the TTL: without renewals it would have expired
        record = LeaseRecord.parse(stored(new_bucket()), "lease")
        assert record.id == mine.id and record.is_live(time.time())
        assert not lost.is_set()
        # Someone else's record replaces ours (as a takeover after a stall would).
        store = new_bucket().store
        _, tag = store.read_tagged(lease_rel(RUN))
        store.replace(lease_rel(RUN), new_record(time.time(), 60, host="thief", pid=7).to_json(), tag)
        assert lost.wait(10)  # at the next renewal, 3.3 s on
        assert "thief" in lease.lost
    finally:
        lease.release()
    assert LeaseRecord.parse(stored(new_bucket()), "lease").host == "thief"  # release left it alone


def test_a_create_whose_answer_was_lost_is_recognised_as_ours(new_bucket, monkeypatch):
    """The write lands, its answer does not, the retry finds the file: the lease is this driver's."""
    bucket = new_bucket()
    create, failed = bucket.store.create, []

    def create_then_lose_the_answer(rel, data):
        tag = create(rel, data)
        if not failed:
            failed.append(1)
            raise FileExistsError("the retry of a create whose first answer was lost")
        return tag

    monkeypatch.setattr(bucket.store, "create", create_then_lose_the_answer)
    lease = lease_of(bucket)
    mine = lease.acquire()
    assert failed and LeaseRecord.parse(stored(bucket), "lease").id == mine.id
    lease.renew()
    lease.release()
    with pytest.raises(FileNotFoundError):
        stored(bucket)


def test_an_unreadable_lease_is_refused_and_left_for_a_person(new_bucket, monkeypatch):
    monkeypatch.setattr("rl_cluster.bucket.lease._UNREADABLE_WAIT_S", 0.01)
    bucket = new_bucket()
    bucket.store.create(lease_rel(RUN), b"")
    with pytest.raises(LeaseHeld, match="not a lease record.*delete .*lease.json"):
        lease_of(new_bucket()).acquire()
    assert stored(bucket) == b""


def test_a_directory_swap_puts_back_a_file_it_did_not_expect(tmp_path):
    """The rename-aside compare-and-swap: a stale tag moves the file aside, finds it is not the one it
    expected, and puts it back unchanged."""
    bucket = Bucket(str(tmp_path / "b"), **FAST_RETRY)
    tag = bucket.store.create("r/f", b"one")
    bucket.store.replace("r/f", b"two", tag)
    with pytest.raises(Conflict):
        bucket.store.replace("r/f", b"three", tag)
    with pytest.raises(Conflict):
        bucket.store.remove("r/f", tag)
    assert bucket.store.read("r/f") == b"two"
    assert listed(tmp_path / "b" / "r") == ["f"]  # nothing left aside


def listed(directory: Path) -> list[str]:
    """The directory's files but the locks beside them (`.<name>.lock`, kept: they are what writers share)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(".lock"))


def test_a_newcomer_never_takes_a_live_lease_while_its_holder_renews(tmp_path):
    """The holder renews over and over while a newcomer tries to create the lease file: the file is never
    absent, so every create is refused and every renewal lands. The rename-aside swap left the name free
    between the holder's rename and its link, and a newcomer created the lease there: the live run then
    lost it (LeaseLost) to a driver that was to be refused."""
    bucket = Bucket(str(tmp_path / "b"), **FAST_RETRY)
    tag = bucket.store.create("r/lease.json", b"holder 0")
    stop, taken = threading.Event(), []

    def newcomer() -> None:
        other = Bucket(str(tmp_path / "b"), **FAST_RETRY)
        while not stop.is_set():
            try:
                other.store.create("r/lease.json", b"newcomer")
                taken.append(True)
                return
            except FileExistsError:
                pass

    thread = threading.Thread(target=newcomer)
    thread.start()
    try:
        for k in range(1, 300):
            tag = bucket.store.replace("r/lease.json", f"holder {k}".encode(), tag)
    finally:
        stop.set()
        thread.join(10)
    assert not taken and bucket.store.read("r/lease.json") == b"holder 299"


def swap_at_once(bucket: Bucket, rel: str, tag: str, writers: int) -> list[bytes]:
    """`writers` threads replace `rel` (tagged `tag`) at the same moment; the bytes of those that won."""
    start = threading.Barrier(writers)
    won = []

    def swap(k: int) -> None:
        data = f"writer {k} ".encode() * 1000
        start.wait()
        try:
            bucket.store.replace(rel, data, tag)
            won.append(data)
        except Conflict:
            pass

    threads = [threading.Thread(target=swap, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return won


def test_concurrent_directory_swaps_leave_exactly_the_winners_bytes(tmp_path):
    """Four writers replace one tagged file at once, 200 times: one wins, and the file holds its bytes.
    An O_EXCL create showed an empty file before its write, which a losing swapper moved aside and put
    back empty (about one round in 25 here, as in a CI run's two-taker lease test)."""
    bucket = Bucket(str(tmp_path / "b"), **FAST_RETRY)
    for round_ in range(200):
        rel = f"r/{round_}"
        won = swap_at_once(bucket, rel, bucket.store.create(rel, b"old"), writers=4)
        assert len(won) == 1 and bucket.store.read(rel) == won[0], round_
    assert listed(tmp_path / "b" / "r") == sorted(map(str, range(200)))


def test_a_mount_without_hard_links_still_creates_and_says_why(tmp_path, monkeypatch, caplog):
    """gcsfuse and s3fs refuse link(2): create falls back to O_EXCL in place and warns, once per directory
    (a renewal creates again every TTL/3), that it is not atomic against a concurrent takeover; the lease
    still works."""

    def no_links(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM), src)

    monkeypatch.setattr(os, "link", no_links)
    bucket = Bucket(str(tmp_path / "b"), **FAST_RETRY)
    lease = lease_of(bucket)
    mine = lease.acquire()
    assert LeaseRecord.parse(stored(bucket), "lease").id == mine.id
    with pytest.raises(LeaseHeld):
        lease_of(Bucket(str(tmp_path / "b"), **FAST_RETRY)).acquire()
    lease.renew()
    assert LeaseRecord.parse(stored(bucket), "lease").expires > mine.expires
    assert caplog.text.count("no hard links") == 1 and "s3://" in caplog.text
    assert listed(tmp_path / "b" / RUN) == ["lease.json"]


@pytest.mark.parametrize("resume", [False, True])
def test_the_entry_point_refuses_a_second_driver_before_ray(tmp_path, resume):
    bucket = Bucket(str(tmp_path / "bucket"))
    holder = bucket.run_lease("x")
    mine = holder.acquire()
    held = bucket.read_bytes("x", "lease.json")
    if resume:  # something to resume, so that only the lease can refuse it
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "trainer_state.json").write_text('{"global_step": 10}')
        bucket.publish_checkpoint("x", 10, tmp_path / "ckpt", base_model="tiny", base_fingerprint="fp")
    before = sorted(p.name for p in (tmp_path / "bucket" / "x").iterdir())
    args = ["--resume", "x"] if resume else ["run_name=x"]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "jobs/train_grpo.py", "--config", "jobs/configs/cpu_demo.toml",
         f"bucket.uri={tmp_path / 'bucket'}", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    took = time.monotonic() - started
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 2, output
    assert output.count("\n") == 0, output  # one line: no Ray start-up, no traceback
    assert output.startswith("run 'x' is in use by another driver"), output
    assert f"host {mine.host}, pid {os.getpid()} since {iso(mine.since)}" in output
    assert "--resume x" in output
    assert took < 20, took  # before Ray: starting a local Ray alone takes about that long here
    # Nothing written: no config.resolved.json (nor config.resumed-*.json), the holder's lease as it was.
    assert sorted(p.name for p in (tmp_path / "bucket" / "x").iterdir()) == before
    assert bucket.read_bytes("x", "lease.json") == held
    holder.release()


def test_a_hung_renewal_loses_the_lease_before_it_expires_and_release_still_returns(tmp_path):
    """A renewal that never answers (a hung mount; a blackholed endpoint takes minutes of retries): the
    renewer tells each renewal's time left to the writer, and gives the lease up with the margin still
    left, before anyone may take it over; release() does not wait for the hung call."""
    bucket = Bucket(str(tmp_path / "bucket"), None, **FAST_RETRY)
    lease = lease_of(bucket, ttl_s=6.0)  # renews every 2 s; margin 1.5 s
    lease.acquire()
    renewed: list[float] = []
    lost: list[tuple[float, str]] = []
    hang = threading.Event()
    lease.start_renewing(lambda why: lost.append((time.time(), why)), renewed.append)
    try:
        deadline = time.monotonic() + 20
        while not renewed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert renewed and 3.0 < renewed[0] <= 6.0  # held for about a TTL from when the renewal began
        bucket.store.replace = lambda *args, **kwargs: hang.wait()  # every renewal from now on hangs
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost, "the renewer never gave the lease up"
        expires = LeaseRecord.parse(stored(bucket), "lease").expires  # the last renewal that landed
        when, why = lost[0]
        assert when < expires - 0.5, (when, expires)  # before anyone else could take it
        assert "could not be renewed while more than 2 s of it were left (no answer yet)" in why
        assert lease.lost == why
        started = time.monotonic()
        lease.release()  # the hung renewal holds the lease's lock: bounded by TTL/6
        assert time.monotonic() - started < 2.0
    finally:
        hang.set()
