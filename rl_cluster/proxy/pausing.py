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
    """`targets()` names the replicas a broadcast reaches; `session` is set once the proxy has one."""

    def __init__(self, lease_s: float, targets: Callable[[], list[HasUrl]], latency: LatencyHistogram):
        self.lease_s = lease_s
        self.targets = targets
        self.latency = latency
        self.session: aiohttp.ClientSession | None = None
        self.paused = False
        self._query = ""  # of the last successful pause, for replicas that join while paused
        self._lock = asyncio.Lock()
        self._lease: asyncio.Task | None = None

    async def pause(self, query: str) -> dict[str, str]:
        """Pause every target; on any failure resume them all. Returns {replica: error} of failures."""
        async with self._lock:
            failures = await self._broadcast("pause", query, self.targets())
            if failures:
                await self._broadcast("resume", "", self.targets())
                self.paused = False
                return failures
            self.paused, self._query = True, query
            self._cancel_lease()
            self._lease = asyncio.get_running_loop().create_task(self._expire())
        return {}

    async def resume(self) -> dict[str, str]:
        async with self._lock:
            self._cancel_lease()
            failures = await self._broadcast("resume", "", self.targets())
            self.paused = bool(failures)
        return failures

    async def match(self, replica: HasUrl) -> None:
        """Bring one replica to the others' state: paused if they are (it would serve while they are
        frozen), else running (it may have missed a resume). Raises if it does not comply."""
        async with self._lock:
            op, query = ("pause", self._query) if self.paused else ("resume", "")
            failures = await self._broadcast(op, query, [replica])
        if failures:
            raise RuntimeError(f"{op} failed: {failures[replica.replica_id]}")

    async def stop(self) -> None:
        """Cancel the lease; replicas left paused are resumed first: a proxy must never leave them frozen."""
        self._cancel_lease()
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

    async def _expire(self) -> None:
        await asyncio.sleep(self.lease_s)
        logger.warning(
            "no /resume within pause_lease_s=%.0fs of the last /pause (did the trainer fail between pause and "
            "resume?): resuming every replica",
            self.lease_s,
        )
        async with self._lock:
            self._lease = None
            failures = await self._broadcast("resume", "", self.targets())
            self.paused = bool(failures)
        if failures:
            logger.error("lease-expiry resume failed on %s", failures)

    async def _broadcast(self, op: str, query: str, replicas: list[HasUrl]) -> dict[str, str]:
        """POST /pause or /resume to `replicas` at once; returns {replica: error} of failures."""

        async def one(replica: HasUrl) -> str | None:
            url = f"{replica.url}/{op}" + (f"?{query}" if query else "")
            try:
                async with self.session.post(url) as response:
                    if response.status == 200:
                        return None
                    return f"HTTP {response.status}: {error_message(await response.text())}"
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
                return f"{type(e).__name__}: {e}"

        start = time.monotonic()
        results = await asyncio.gather(*(one(r) for r in replicas))
        self.latency.observe(op, time.monotonic() - start)
        return {r.replica_id: err for r, err in zip(replicas, results, strict=True) if err is not None}
