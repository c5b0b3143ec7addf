"""Replicas the proxy lost track of come back: registered down, then taken in when they answer.

A restarted proxy learns its replicas from the run's pool controller (ProxyServer.restore). One whose
server is mid-restart, or whose generator does not answer in time, used to be skipped: its later report
that it is back was a no-op for a replica the proxy did not know, it never routed again, and the pool
controller counted it as starting for the rest of the run (and so never replaced it). Now:

- one whose server does not answer is registered down with its address: the health watch probes it and
  catches it up when it answers, as any replica that was down;
- one whose generator did not say where it serves is registered down by name only; each health round,
  and its report that it is back, asks its generator again (`find`, the ProxyActor's lookup of the
  generator actor by name) and registers it once it answers;
- one the pool removed stays removed: a late report from it registers nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from rl_cluster.config import ProxyConfig
from rl_cluster.core.versions import VersionBook
from rl_cluster.proxy.adapter_loader import AdapterLoader
from rl_cluster.proxy.health import HealthWatch
from rl_cluster.proxy.replica import Member, NotReached, Replica

logger = logging.getLogger(__name__)


class Rejoins:
    """Over the pool's `replicas` and `book` (shared, not copied); `add` is the pool's registration
    (ReplicaPool.add: catch-up, then active)."""

    def __init__(
        self,
        config: ProxyConfig,
        replicas: dict[str, Replica],
        book: VersionBook,
        health: HealthWatch,
        add: Callable[..., Awaitable[None]],
    ):
        self.config = config
        self.replicas = replicas
        self.book = book
        self.health = health
        self.add = add
        # Where a replica serves, asked of its generator: None while it has no server. None: no way to
        # ask (a proxy in front of bare vLLM servers); such a replica waits until it registers itself.
        self.find: Callable[[str], Awaitable[Member | None]] | None = None
        self.removed: set[str] = set()  # replicas removed for good: never registered again here

    async def admit(self, replica_id: str, member: Member) -> bool:
        """Register the replica as `add` does; if that fails (its server does not answer yet, or dies
        during its catch-up), register it down instead. True when it serves."""
        try:
            await self.add(replica_id, member.url, member.control, member.capacity)
            return True
        except Exception as e:
            why = f"could not join: {type(e).__name__}: {e}"
            self.register_down(replica_id, why, member.url, member.control, member.capacity)
            return False

    def register_down(
        self,
        replica_id: str,
        reason: str,
        url: str = "",
        loader: AdapterLoader | None = None,
        capacity: int | None = None,
    ) -> None:
        """Register the replica out of routing: the health watch probes `url` and catches it up when it
        answers, or, with no `url`, asks its generator where it serves (`rejoin`). A replica registered
        meanwhile (its own registration won the race) is left as it is, but one known by name only
        learns where it serves."""
        current = self.replicas.get(replica_id)
        if current is not None and not current.url and url:  # probed there from now on
            current.url, current.loader, current.capacity = url, loader or current.loader, capacity
        if current is not None or replica_id in self.removed:
            return
        self.book.add_replica(replica_id, down=True)
        self.book.loads.set_capacity(replica_id, capacity)
        self.replicas[replica_id] = Replica(replica_id, url, loader or NotReached(), capacity=capacity)
        self.health.down_reasons[replica_id] = reason
        logger.warning("replica %s registered out of routing: %s", replica_id, reason)

    async def rejoin(self, replica_id: str) -> None:
        """A replica the proxy does not know, or knows only by name, is (or may be) up: ask its generator
        where it serves (bounded by health_timeout_s) and register it. Until that succeeds it stays
        registered down, and the health watch asks again each round."""
        current = self.replicas.get(replica_id)
        if self.find is None or replica_id in self.removed or (current is not None and current.url):
            return
        try:
            async with asyncio.timeout(self.config.health_timeout_s):
                member = await self.find(replica_id)
        except Exception as e:
            self.register_down(
                replica_id, f"its generator did not say where it serves: {type(e).__name__}: {e}"
            )
            return
        if member is None:  # no server yet: it registers by itself once it has one
            self.register_down(replica_id, "its generator has no server yet")
            return
        current = self.replicas.get(replica_id)
        if current is not None and current.url:
            return  # registered meanwhile
        if await self.admit(replica_id, Member(*member)):
            logger.warning("replica %s rejoined the proxy", replica_id)
