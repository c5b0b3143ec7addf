"""Pause and resume every replica together, and never leave them paused for long.

TRL pauses the servers around a weight sync. The proxy makes that all-or-nothing (a pause that fails
anywhere is undone everywhere), keeps a lease (a pause without a resume within pause_lease_s is ended by
the proxy: a trainer that died between the two must not freeze the cluster), and brings replicas that
join or come back to the same state as the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

import aiohttp

from rl_cluster.proxy.adapter_loader import error_message
from rl_cluster.proxy.metrics import LatencyHistogram

logger = logging.getLogger(__name__)


class HasUrl(Protocol):
    replica_id: str
    url: str


class PauseCoordinator:
    """`targets()` names the replicas a broadcast reaches; `session` is set once the proxy has one.

    Every call to a replica is bounded by `deadline_s` (a pause that waits for requests, mode=wait, by
    `lease_s`: it holds the lock, and so resume, the lease's expiry and every catch-up). A replica that
    gives no answer in time, or none at all, is down:
    `down(replica, reason)` takes it out of routing and it is left out (its catch-up matches it to the
    others' state when it answers again). A replica that answers a resume with an error stays on the
    `unconfirmed` list and is asked again every `retry_s` until it confirms, leaves, or a pause supersedes
    it: replicas are never left paused because one call failed.
    """

    def __init__(
        self,
        lease_s: float,
        targets: Callable[[], list[HasUrl]],
        latency: LatencyHistogram,
        *,
        deadline_s: float = 60.0,
        retry_s: float = 2.0,
        down: Callable[[str, str], None] = lambda replica_id, reason: None,
    ):
        self.lease_s = lease_s
        self.targets = targets
        self.latency = latency
        self.deadline_s = deadline_s
        self.retry_s = retry_s
        self.down = down
        self.session: aiohttp.ClientSession | None = None
        self.wanted = False  # paused between a successful pause and the next resume (or lease expiry)
        self.unconfirmed: set[str] = set()  # replicas that may still be paused although none should be
        self._query = ""  # of the last successful pause, for replicas that join while paused
        self._lock = asyncio.Lock()
        self._lease: asyncio.Task | None = None
        self._retry: asyncio.Task | None = None

    @property
    def paused(self) -> bool:
        """True while any replica may be paused: wanted so, or a resume not yet confirmed everywhere."""
        return self.wanted or bool(self.unconfirmed)

    async def pause(self, query: str) -> dict[str, str]:
        """Pause every target; on any failure resume them all. Returns {replica: error} of failures."""
        async with self._lock:
            failures = await self._broadcast("pause", query, self.targets())
            if failures:
                await self._resume_all()
                return failures
            self.wanted, self._query = True, query
            self.unconfirmed.clear()  # each target just confirmed the pause: the next resume covers it
            self._cancel_lease()
            self._lease = asyncio.get_running_loop().create_task(self._expire())
        return {}

    async def resume(self) -> dict[str, str]:
        """Resume every target. Returns {replica: error} of those that refused; they are asked again."""
        async with self._lock:
            self._cancel_lease()
            return await self._resume_all()

    async def match(self, replica: HasUrl) -> None:
        """Bring one replica to the others' state: paused if they are (it would serve while they are
        frozen), else running (it may have missed a resume). Raises if it does not comply."""
        async with self._lock:
            op, query = ("pause", self._query) if self.wanted else ("resume", "")
            failures = await self._broadcast(op, query, [replica], leave_out_down=False)
            if op == "resume" and not failures:
                self.unconfirmed.discard(replica.replica_id)
        if failures:
            raise RuntimeError(f"{op} failed: {failures[replica.replica_id]}")

    async def stop(self) -> None:
        """Cancel the lease; replicas left paused are resumed first: a proxy must never leave them frozen."""
        self._cancel_lease()
        if self._retry is not None:
            self._retry.cancel()
        if self.paused:
            logger.warning("proxy stopping while replicas are paused: resuming them")
            try:
                await self._broadcast("resume", "", self.targets())
            except Exception:
                logger.exception("resuming replicas at proxy stop failed")

    def _cancel_lease(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None

    async def _resume_all(self) -> dict[str, str]:
        """Resume every target (under the lock); the ones that refuse are retried in the background."""
        self.wanted = False
        failures = await self._broadcast("resume", "", self.targets())
        self.unconfirmed = set(failures)
        if failures:
            logger.warning("resume refused by %s: asking again every %.0f s", failures, self.retry_s)
            if self._retry is None or self._retry.done():
                self._retry = asyncio.get_running_loop().create_task(self._confirm_resume())
        return failures

    async def _confirm_resume(self) -> None:
        """Ask the replicas that refused a resume again until each confirmed, left the pool or went down
        (a returning replica is resumed by its catch-up), or a pause made the question moot."""
        while self.unconfirmed and not self.wanted:
            await asyncio.sleep(self.retry_s)
            async with self._lock:
                if self.wanted:
                    return
                reachable = {r.replica_id: r for r in self.targets()}
                self.unconfirmed &= set(reachable)
                failures = await self._broadcast("resume", "", [reachable[r] for r in self.unconfirmed])
                self.unconfirmed = set(failures)
        if not self.wanted:
            logger.info("every replica confirmed the resume")

    async def _expire(self) -> None:
        await asyncio.sleep(self.lease_s)
        logger.warning(
            "no /resume within pause_lease_s=%.0fs of the last /pause (did the trainer fail between pause and "
            "resume?): resuming every replica",
            self.lease_s,
        )
        async with self._lock:
            self._lease = None
            failures = await self._resume_all()
        if failures:
            logger.error("lease-expiry resume failed on %s", failures)

    async def _broadcast(
        self, op: str, query: str, replicas: list[HasUrl], leave_out_down: bool = True
    ) -> dict[str, str]:
        """POST /pause or /resume to `replicas` at once; returns {replica: error} of failures. With
        `leave_out_down`, those that gave no answer (in time) are down: reported, and not failures."""
        # A pause that waits for in-flight requests (mode=wait) may take as long as they do, but no longer
        # than the lease a pause gets: under the lock, an unbounded call would hold resume, the lease's
        # expiry and every catch-up behind one replica that never answers.
        waits = "mode=wait" in query
        bound, bound_name = (self.lease_s, "pause_lease_s") if waits else (self.deadline_s, "load_deadline_s")
        timeout = aiohttp.ClientTimeout(total=bound)

        async def one(replica: HasUrl) -> str | None:
            url = f"{replica.url}/{op}" + (f"?{query}" if query else "")
            try:
                async with self.session.post(url, timeout=timeout) as response:
                    if response.status == 200:
                        return None
                    return f"HTTP {response.status}: {error_message(await response.text())}"
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
                what = (
                    f"no answer within {bound_name}={bound:g}s"
                    if isinstance(e, TimeoutError)
                    else "no answer"
                )
                reason = f"{op}: {what} ({type(e).__name__}: {e})"
                if not leave_out_down:
                    return reason
                self.down(replica.replica_id, reason)
                return None

        start = time.monotonic()
        results = await asyncio.gather(*(one(r) for r in replicas))
        self.latency.observe(op, time.monotonic() - start)
        return {r.replica_id: err for r, err in zip(replicas, results, strict=True) if err is not None}
