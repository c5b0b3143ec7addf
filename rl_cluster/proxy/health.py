"""Replica health: active -> unhealthy when it stops answering, unhealthy -> catching up when it answers.

A replica leaves routing (and broadcasts) the moment the proxy has reason to think it is down: a failed
health check, a failed request or broadcast whose probe then fails, or its actor saying so. Nothing here
forgets a replica: a down one comes back by itself (its actor restarts it), so the watch keeps probing
it, and the pool catches it up when it answers (rl_cluster.proxy.replicas, under the adapter lock). A
replica registered down before the proxy ever reached it (a restarted proxy whose restore found it
unanswering) has no address to probe: the watch asks its generator for one instead (`rejoin`), and so
does a report that it is back from a replica the proxy does not know. For the same reason requests and
loads that find no active replica wait for one, bounded, rather than fail.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine

import aiohttp

from rl_cluster.config import ProxyConfig
from rl_cluster.core.versions import ReplicaState, VersionBook
from rl_cluster.errors import ReplicaDown, ReplicaMisbehaved, ReplicaTimeout, ReplicaUnreachable
from rl_cluster.proxy.forward import ReplicaFailed
from rl_cluster.proxy.replica import Replica, probe

logger = logging.getLogger(__name__)


class HealthWatch:
    """Watches the pool's `replicas` (the pool's own dict and book, shared, not copied) and moves them
    between active and unhealthy; `catch_up_again` brings an unhealthy one that answers back to active,
    `rejoin` registers one known only by name, or not at all (None: such a replica waits)."""

    def __init__(
        self,
        config: ProxyConfig,
        replicas: dict[str, Replica],
        book: VersionBook,
        spawn: Callable[[Coroutine], asyncio.Task],
        catch_up_again: Callable[[Replica], Awaitable[None]],
        rejoin: Callable[[str], Awaitable[None]] | None = None,
    ):
        self.config = config
        self.replicas = replicas
        self.book = book
        self.spawn = spawn
        self.catch_up_again = catch_up_again
        self.rejoin = rejoin
        self.session: aiohttp.ClientSession | None = None
        self.down_reasons: dict[str, str] = {}  # replica -> why it last left routing
        # Replicas a catch-up is under way for: a health round and report_back must not start a second.
        self._recovering: set[str] = set()

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check()
            except Exception:
                logger.exception("health check round failed")

    async def check(self) -> None:
        """One round: active replicas that fail leave routing; unhealthy ones that answer catch up again."""
        watched = [self.replicas[r] for r in self.book.in_state(ReplicaState.ACTIVE, ReplicaState.UNHEALTHY)]
        for replica in watched:
            if not replica.url and self.rejoin is not None:  # never reached: ask its generator where it is
                self._start_recovery(replica.replica_id, self.rejoin(replica.replica_id))
        watched = [replica for replica in watched if replica.url]
        results = await asyncio.gather(*(self.probe(r) for r in watched))
        for replica, problem in zip(watched, results, strict=True):
            rid = replica.replica_id
            if self.replicas.get(rid) is not replica:
                continue  # removed (or replaced) meanwhile
            state = self.book.state(rid)
            if problem and state is ReplicaState.ACTIVE:
                self.mark_unhealthy(rid, f"health check failed: {problem}")
            elif not problem and state is ReplicaState.UNHEALTHY:
                self._start_recovery(rid, self.catch_up_again(replica))

    async def probe(self, replica: Replica) -> str | None:
        """None when the replica's /health answers 200 within health_timeout_s, else what went wrong."""
        return await probe(self.session, replica.url, self.config.health_timeout_s)

    def mark_unhealthy(self, replica_id: str, reason: str) -> None:
        if self.book.mark_unhealthy(replica_id):
            self.down_reasons[replica_id] = reason  # the stats say why (the run's `faults` name it)
            logger.warning("replica %s left routing: %s", replica_id, reason)

    def report_down(self, replica_id: str, reason: str) -> None:
        if replica_id in self.replicas:
            self.mark_unhealthy(replica_id, reason)

    async def report_back(self, replica_id: str) -> None:
        """Catch a restarted replica up now (a restart can be quicker than the health-check interval, and
        the new server holds none of the adapters the book says it has)."""
        if replica_id in self._recovering:
            return  # a health check already found the new server and is catching it up
        replica = self.replicas.get(replica_id)
        if replica is None or not replica.url:
            # Not known (a restarted proxy did not reach it), or known only by name: registered now, or
            # the replica would stay out of the pool for the rest of the run.
            recovery = None if self.rejoin is None else self.rejoin(replica_id)
        else:
            self.mark_unhealthy(replica_id, "its server was restarted")
            recovery = self.catch_up_again(replica)
        if recovery is not None:
            self._recovering.add(replica_id)
            await self._recover(replica_id, recovery)

    async def is_down(self, replica_id: str, error: BaseException) -> bool:
        """During a broadcast: is the replica that failed it down? Then it leaves routing (and catches up
        when it is back) instead of failing the broadcast for the replicas that are fine."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            problem = "removed"
        elif isinstance(error, ReplicaTimeout):  # hung or cut off: its /health may still answer (a stall)
            problem = "missed its deadline"
        elif isinstance(error, ReplicaMisbehaved):  # healthy by /health, but it lied about the load
            problem = "not asked: its answer broke the protocol"
        elif isinstance(error, ReplicaUnreachable):  # cut off (or was, and Ray has not reconnected yet)
            problem = "its actor is out of reach"
        elif isinstance(error, ReplicaDown):  # its actor says so; its old server may linger a few seconds
            problem = "no server"
        else:
            problem = await self.probe(replica)
        if problem and replica is not None:
            self.mark_unhealthy(replica_id, f"{type(error).__name__}: {error}; health check: {problem}")
        return problem is not None

    async def replica_failed(self, failure: ReplicaFailed) -> bool:
        """After a failed generation: is the replica down? Down ones leave routing at once."""
        replica = self.replicas.get(failure.replica_id)
        if replica is None:
            return True
        # A replica that sent nothing for the read deadline is hung whatever its /health says (a wedged
        # engine behind a live API server), and one that broke the protocol is not to be trusted with the
        # next request: out of routing, back when a health round finds it well and a catch-up sound.
        if failure.timed_out:
            problem = "missed the read deadline"
        elif failure.misbehaved:
            problem = "not asked: its answer broke the protocol"
        else:
            problem = await self.probe(replica)
        if problem:
            self.mark_unhealthy(replica.replica_id, f"{failure}; health check: {problem}")
        return problem is not None

    async def wait_for_active(self, timeout_s: float | None = None) -> bool:
        """True once a replica is active; False when none was for `timeout_s` (None:
        proxy.unavailable_timeout_s). A replica that is down comes back by itself (its actor restarts it),
        so requests wait for it rather than fail the run at once."""
        deadline = time.monotonic() + (self.config.unavailable_timeout_s if timeout_s is None else timeout_s)
        while not self.book.active():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.25)
        return True

    def _start_recovery(self, replica_id: str, recovery: Coroutine) -> None:
        """Run `recovery` in the background unless one for the replica is under way already."""
        if replica_id in self._recovering:
            recovery.close()
            return
        self._recovering.add(replica_id)
        self.spawn(self._recover(replica_id, recovery))

    async def _recover(self, replica_id: str, recovery: Awaitable[None]) -> None:
        try:
            await recovery
        finally:
            self._recovering.discard(replica_id)
