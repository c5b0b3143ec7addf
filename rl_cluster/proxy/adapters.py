"""Adapter versions across the pool: publish one on every active replica, close one, unload it when idle.

A load goes to every active replica, all-or-nothing (rl_cluster.proxy.broadcast does the calls), and
the name becomes routable only when every one confirmed; a replica that turns out to be down meanwhile
leaves routing instead of failing the load, and catches up when it is back. An unload closes the name at
once and each replica unloads it when its last request for it ends. The pool's adapter lock serialises
loads, closes and catch-ups, so a replica that catches up cannot miss a version published meanwhile.

One load has one deadline, `proxy.load_timeout_s`, below the trainer's client timeout: every step
before the broadcast (waiting for an active replica, for the lock, for a replica to return when all
were down) ends in time for one broadcast, whose own steps are bounded per replica (ProxyConfig.
broadcast_s), to finish by then. A load that cannot start in time fails with LoadTimedOut (504) having
loaded nothing, so the client always learns the outcome from the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine

from rl_cluster.config import ProxyConfig
from rl_cluster.core.deadline import Deadline
from rl_cluster.core.versions import ReplicaState, VersionBook
from rl_cluster.errors import AdapterError, AdapterNotFound, ReplicaTimeout
from rl_cluster.proxy.broadcast import LoadFailed, load_everywhere, unload_within
from rl_cluster.proxy.health import HealthWatch
from rl_cluster.proxy.metrics import LatencyHistogram
from rl_cluster.proxy.replica import Replica

logger = logging.getLogger(__name__)


class AdapterExists(Exception):
    """A load of a name the proxy already knows: names are never reused for different weights."""


class NoActiveReplica(Exception):
    """Nothing to broadcast to: no replica is active (after `waited_s` of waiting, ended by the `bound`)."""

    def __init__(self, waited_s: float = 0.0, bound: str = "proxy.unavailable_timeout_s"):
        super().__init__(f"no active replica after {waited_s:.1f} s ({bound})")
        self.waited_s, self.bound = waited_s, bound


class LoadTimedOut(Exception):
    """A load could not begin its broadcast in time to end by proxy.load_timeout_s; nothing was loaded."""

    def __init__(self, name: str, timeout_s: float, waiting_for: str):
        super().__init__(
            f"loading adapter {name!r}: still waiting for {waiting_for} when a broadcast could no longer "
            f"end within proxy.load_timeout_s={timeout_s:g}; nothing was loaded"
        )


class AdapterBroadcasts:
    """Loads and closes over the pool's `replicas` and `book` (shared, not copied), under its `lock`;
    `health` judges the replicas a load failed on and waits for an active one."""

    def __init__(
        self,
        config: ProxyConfig,
        latency: LatencyHistogram,
        replicas: dict[str, Replica],
        book: VersionBook,
        lock: asyncio.Lock,
        spawn: Callable[[Coroutine], asyncio.Task],
        health: HealthWatch,
    ):
        self.config = config
        self.latency = latency
        self.replicas = replicas
        self.book = book
        self.lock = lock
        self.spawn = spawn
        self.health = health

    async def load(self, name: str, path: str) -> list[str]:
        """Load `name` on every active replica, all-or-nothing; it is routable when this returns. Returns
        the replicas it went to. Raises AdapterExists, NoActiveReplica, LoadTimedOut or broadcast.LoadFailed.
        Over by proxy.load_timeout_s, whatever the replicas do."""
        # A broadcast must start by `start_by` to end by the load's deadline.
        start_by = Deadline.after(self.config.load_timeout_s - self.config.broadcast_s)
        waiting = Deadline.after(self.config.unavailable_timeout_s)  # for a replica, when all were down
        began = time.monotonic()
        while True:
            try:
                targets = await self._load_once(name, path, start_by)
                break
            except (NoActiveReplica, LoadFailed) as e:
                # No replica to load on: every one it went to was down (a one-replica run whose engine just
                # died), or the one its wait saw active left before the lock was the load's (a catch-up held
                # it). Like a request, the sync waits for one to come back, bounded; not a 503 at once.
                if isinstance(e, LoadFailed) and not e.all_down:
                    raise
                if start_by.expired or waiting.expired:
                    if isinstance(e, LoadFailed):
                        raise
                    bound = "proxy.load_timeout_s" if start_by.expired else "proxy.unavailable_timeout_s"
                    raise NoActiveReplica(time.monotonic() - began, bound) from None
                logger.warning("no replica to load %s on: waiting for one to return", name)
        # A target may have left meanwhile (a drained replica's generator stops during the load).
        routable_on = [r for r in targets if r in self.replicas and name in self.book.loaded_on(r)]
        logger.info("adapter %s routable on %s", name, routable_on)
        return routable_on

    async def _load_once(self, name: str, path: str, start_by: Deadline) -> list[str]:
        """One all-or-nothing load over the replicas active now, begun by `start_by`; returns them (raises
        as `load`)."""
        # Outside the lock: a returning replica's catch-up takes it before the replica is active.
        await self.health.wait_for_active(start_by.within(self.config.unavailable_timeout_s))
        try:
            # Catch-ups hold the lock for as long as their loads take (versions x load_deadline_s).
            async with asyncio.timeout(start_by.left()):
                await self.lock.acquire()
        except TimeoutError:
            raise LoadTimedOut(name, self.config.load_timeout_s, "the adapter lock (catch-ups)") from None
        try:
            return await self._broadcast(name, path)
        finally:
            self.lock.release()

    async def _broadcast(self, name: str, path: str) -> list[str]:
        """The load itself, under the lock: bounded by ProxyConfig.broadcast_s."""
        if self.book.known(name):
            raise AdapterExists(name)
        targets = self.book.active()
        if not targets:
            raise NoActiveReplica()
        start = time.monotonic()
        try:
            await load_everywhere(
                name,
                path,
                {r: self.replicas[r].loader for r in targets},
                retry_s=self.config.load_retry_interval_s,
                deadline_s=self.config.load_deadline_s,
                # A replica removed meanwhile is not marked.
                loaded=lambda r: self.book.mark_loaded(r, name) if r in self.replicas else None,
                holders=lambda: self.book.holders(name),
                unloaded=lambda r: self.book.mark_unloaded(r, name),
                down=self.health.is_down,
            )
        finally:
            self.latency.observe("load", time.monotonic() - start)
        self.book.publish(name, path)
        return targets

    async def close(self, name: str) -> bool:
        """Close `name` to new requests; each replica unloads it once nothing for it is in flight there.
        False when the name is unknown."""
        async with self.lock:
            if not self.book.known(name):
                return False
            if not self.book.is_closed(name):
                for replica_id in self.book.close(name):
                    self.spawn(self.unload_on(replica_id, name))
        return True

    async def unload_on(self, replica_id: str, name: str) -> None:
        """Unload a closed `name` on one replica (its last request for it has ended)."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            return
        if self.book.state(replica_id) is ReplicaState.UNHEALTHY:
            return  # its catch-up reads back what it serves and unloads what is closed
        start = time.monotonic()
        try:
            await unload_within(replica.loader, name, self.config.load_deadline_s)
        except AdapterNotFound:
            pass  # already gone: the goal is reached
        except ReplicaTimeout as e:
            # Hung: out of routing; its catch-up reads back what it serves and unloads what is closed.
            self.health.mark_unhealthy(replica_id, str(e))
            return
        except AdapterError as e:
            # Left marked as loaded (and closed): it still occupies a slot on that replica, and we say so.
            # An unreachable replica is out of routing at the next health round, and its catch-up retries.
            logger.warning("unloading adapter %s on replica %s failed: %s", name, replica_id, e)
            return
        except Exception:
            logger.exception("unloading adapter %s on replica %s failed", name, replica_id)
            return
        finally:
            self.latency.observe("unload", time.monotonic() - start)
        self.book.mark_unloaded(replica_id, name)
        logger.info("adapter %s unloaded on replica %s", name, replica_id)
