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
  Each renewal tells the run's writer for how long the lease is held from then on (`valid_for`), and the
  writer fences itself by that (rl_cluster/core/fence.py). A renewal is waited for a bounded time (a hung
  mount or a blackholed endpoint would hold it for minutes); the lease counts as lost once less than
  `margin_s` of it is left unrenewed, before anyone else may take it.
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

import logging
import threading
import time
from collections.abc import Callable

from rl_cluster.bucket.lease_record import LeaseRecord, held_message, holder_gone, iso, new_record
from rl_cluster.bucket.store import Conflict, Store
from rl_cluster.errors import LeaseHeld, LeaseLost

log = logging.getLogger(__name__)

LEASE_TTL_S = 60.0  # long enough to ride out a bucket's hiccup, short enough to wait for after a crash
# Rounds of create / read / take over before giving up on a lease that keeps changing under us.
_ATTEMPTS = 5
_UNREADABLE_WAIT_S = 0.2  # a file being created on a mount may be empty for a moment


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
        self.margin_s = ttl_s / 4  # the writer's fence and the renewer's give-up, before the lease expires
        self._held_until = 0.0  # on time.monotonic(): a TTL after the last write of `record` began
        self._tag = ""  # the store's tag of `record`: conditional writes name it
        self._lock = threading.Lock()  # the renewer and release never interleave
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- acquire

    def acquire(self) -> LeaseRecord:
        """Take the lease: create it, or take over an expired one. LeaseHeld while another's is live."""
        mine = new_record(self.clock(), self.ttl_s)
        for _ in range(_ATTEMPTS):
            began = time.monotonic()
            try:
                return self._hold(mine, self.store.create(self.rel, mine.to_json()), began)
            except FileExistsError:
                pass
            try:
                current, tag = self._read()
            except FileNotFoundError:
                continue  # released between our create and our read: create again
            if current.id == mine.id:
                # Our create (or takeover) went through, its answer was lost, and the retry found the file.
                return self._hold(current, tag, began)
            gone = holder_gone(current)
            if current.is_live(self.clock()) and not gone:
                raise LeaseHeld(held_message(self.run_name, self.uri, current, self.ttl_s))
            log.warning(
                "%s: taking over the lease %s held by %s, %s",
                *(self.run_name, self.uri, current.holder),
                "whose process is gone" if gone else f"expired at {iso(current.expires)}",
            )
            mine, began = new_record(self.clock(), self.ttl_s), time.monotonic()
            try:
                return self._hold(mine, self.store.replace(self.rel, mine.to_json(), tag), began)
            except Conflict:
                continue  # another driver took it over first (or its holder renewed it late): look again
        raise LeaseHeld(
            f"run {self.run_name!r}: {self.uri} changed {_ATTEMPTS} times while this driver tried to take "
            "it; another driver is starting under the same run_name. Wait, or pick another run_name."
        )

    def _hold(self, record: LeaseRecord, tag: str, began: float) -> LeaseRecord:
        self.record, self._tag, self.lost = record, tag, None
        self._held_until = began + self.ttl_s
        return record

    def valid_for(self) -> float:
        """Seconds from now that the lease is this process's at least, on its monotonic clock: a TTL from
        when its last successful write began (the record's `expires` is later still)."""
        return max(0.0, self._held_until - time.monotonic()) if self.record is not None else 0.0

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
            mine, began = self.record.renewed(self.clock(), self.ttl_s), time.monotonic()
            for _ in range(2):
                try:
                    self._tag = self.store.replace(self.rel, mine.to_json(), self._tag)
                    self.record, self._held_until = mine, began + self.ttl_s
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

    def start_renewing(
        self, on_lost: Callable[[str], None], on_renewed: Callable[[float], None] | None = None
    ) -> None:
        """Renew every TTL/3 on a daemon thread until `release`, telling `on_renewed(valid_for())` after each
        renewal. When the lease is lost (taken over, or less than `margin_s` of it left unrenewed, a renewal
        in flight or not), call `on_lost(why)` once and stop."""

        def renew_until_released() -> None:
            renewal: _Renewal | None = None
            wait = self.ttl_s / 3
            while not self._stop.wait(wait):
                renewal = renewal or _Renewal(self.renew)
                # Waited for no longer than the lease has to spare: the loss is told before the margin.
                done = renewal.done.wait(max(0.0, min(self.ttl_s / 6, self.valid_for() - self.margin_s)))
                if done and renewal.error is None:
                    renewal, wait = None, self.ttl_s / 3
                    if on_renewed is not None:
                        on_renewed(self.valid_for())
                    continue
                if done and isinstance(renewal.error, LeaseLost):
                    why = str(renewal.error)
                else:
                    problem = f"{type(renewal.error).__name__}: {renewal.error}" if done else "no answer yet"
                    renewal = None if done else renewal  # one renewal in flight at a time
                    spare = self.valid_for() - self.margin_s
                    if spare > 0:
                        log.warning("%s: could not renew %s (%s); retrying", self.run_name, self.uri, problem)
                        wait = min(self.ttl_s / 12, spare)
                        continue
                    why = (
                        f"{self.uri} could not be renewed while more than {self.margin_s:.0f} s of it were "
                        f"left ({problem})"
                    )
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
        # Bounded: a renewal hung on the bucket holds the lock, and the driver must still exit.
        if not self._lock.acquire(timeout=self.ttl_s / 6):
            self._left(TimeoutError(f"a renewal has held it for over {self.ttl_s / 6:.0f} s"))
            return
        try:
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
        finally:
            self._lock.release()

    def _left(self, e: Exception) -> None:
        log.warning(
            "%s: could not delete %s (%s: %s); it expires %.0f s after its last renewal",
            *(self.run_name, self.uri, type(e).__name__, e, self.ttl_s),
        )


class _Renewal:
    """One renewal, on a thread of its own, so that the renewer can give up waiting for it (the store's own
    retries against a blackholed endpoint take minutes, and a hung mount never answers)."""

    def __init__(self, renew: Callable[[], None]):
        self.error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(renew,), name="run-lease-renewal", daemon=True).start()

    def _run(self, renew: Callable[[], None]) -> None:
        try:
            renew()
        except BaseException as e:  # handed to the renewer, which decides
            self.error = e
        finally:
            self.done.set()
