"""The replica pool: every replica behind the proxy, and its life from joining to gone.

A replica's life (the states are rl_cluster.core.versions.ReplicaState; VersionBook enforces them):

    add()      joining -> catching up -> active           registered, then loads every live adapter
                                                          version and takes the others' pause state
    a failed health check, or a failed request
    whose probe fails:       active -> unhealthy          out of routing and broadcasts at once
    the health watch sees it answer again:
                             unhealthy -> catching up -> active   (it may have restarted empty)
    remove()   active -> draining -> gone                 no new requests; in-flight ones finish
                                                          (bounded), then it is forgotten

Catching up is the same whether a replica is new or returning: read back what it serves, load what it
lacks, unload what was closed while it was away, match the pause state, activate. Because adapters
arrive by path from the bucket, it needs nothing from the other replicas.
A replica the proxy could not reach (a restarted proxy's restore) is registered down rather than left
out, and one it does not know that reports back is registered: rl_cluster.proxy.rejoin.

The pool holds the registry and the membership steps (joining, catching up, draining, request counts);
the rest of a replica's life is in the parts it is composed of, each over the same registry:
rl_cluster.proxy.health (active <-> unhealthy), rl_cluster.proxy.adapters (adapter loads and closes)
and rl_cluster.proxy.pausing (pause and resume). One lock serialises loads, closes and catch-ups, so a
replica that catches up cannot miss a version published meanwhile. Broadcasts run as tasks the pool
owns: a client that hangs up mid-broadcast must not leave the replicas half-changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp

from rl_cluster.config import ProxyConfig
from rl_cluster.core.routing import PrefixTable
from rl_cluster.core.versions import ReplicaState, VersionBook
from rl_cluster.proxy.adapter_loader import INFO_TIMEOUT, AdapterLoader, served_models
from rl_cluster.proxy.adapters import AdapterBroadcasts, AdapterExists, NoActiveReplica
from rl_cluster.proxy.broadcast import load_with_retry
from rl_cluster.proxy.forward import ReplicaFailed
from rl_cluster.proxy.health import HealthWatch
from rl_cluster.proxy.metrics import LatencyHistogram
from rl_cluster.proxy.pausing import PauseCoordinator
from rl_cluster.proxy.rejoin import Rejoins
from rl_cluster.proxy.replica import Member, Replica, learn_capacity

# The server and the dispatcher meet the pool's record, errors and admin timeout here, with the pool.
__all__ = ["INFO_TIMEOUT", "AdapterExists", "Member", "NoActiveReplica", "Replica", "ReplicaPool"]

logger = logging.getLogger(__name__)

# Replicas that are reachable for broadcasts (pause/resume): every one but those known to be down.
REACHABLE = (ReplicaState.JOINING, ReplicaState.CATCHING_UP, ReplicaState.ACTIVE, ReplicaState.DRAINING)


class ReplicaPool:
    """The registry (`replicas`, their states and adapters in `book`, their cached prefixes in `table`)
    and everything that changes it. Runs on the proxy's event loop; `start` hands it the admin session."""

    def __init__(self, config: ProxyConfig, latency: LatencyHistogram):
        self.config = config
        self.latency = latency
        self.book = VersionBook()
        self.table = PrefixTable(config.table_capacity)
        # Shared with the parts below, which read and change it in place: never rebind it.
        self.replicas: dict[str, Replica] = {}
        self.base_models: list[str] = []  # learnt from the first replica's /v1/models
        self.session: aiohttp.ClientSession | None = None
        self._adapter_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self._drained = asyncio.Event()
        # Pause/resume reach every replica but those known to be down (catch-up syncs them on return).
        self.health = HealthWatch(
            config,
            self.replicas,
            self.book,
            self.spawn,
            self._catch_up_again,
            lambda r: self.rejoins.rejoin(r),
        )
        self.rejoins = Rejoins(config, self.replicas, self.book, self.health, self.add)
        self.pausing = PauseCoordinator(
            config.pause_lease_s,
            lambda: [self.replicas[r] for r in self.book.in_state(*REACHABLE)],
            latency,
            deadline_s=config.load_deadline_s,
            retry_s=config.load_retry_interval_s,
            down=self.health.report_down,
        )
        self.adapters = AdapterBroadcasts(
            config, latency, self.replicas, self.book, self._adapter_lock, self.spawn, self.health
        )

    def start(self, session: aiohttp.ClientSession) -> None:
        """Use `session` for every admin call to a replica, and start watching their health."""
        self.session = self.pausing.session = self.health.session = session
        self.spawn(self.health.watch())

    async def stop(self) -> None:
        """Resume replicas left paused (a proxy must never leave them frozen), then cancel own tasks."""
        await self.pausing.stop()
        for task in list(self._background):
            task.cancel()

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """A background task the pool owns (kept referenced, cancelled at stop)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _detached(self, coro: Coroutine) -> Any:
        """Run a broadcast to completion even if the caller is cancelled (its HTTP client hung up):
        half a broadcast load or pause would leave the replicas inconsistent."""
        return await asyncio.shield(self.spawn(coro))

    # -- joining and catching up ------------------------------------------------------------------------

    def adopt(self, versions: dict[str, str]) -> None:
        """Make `versions` (name -> bucket path) routable before any replica is registered: what the
        replicas of a restarted proxy serve. Each replica loads those it lacks when it catches up."""
        if self.replicas:
            raise RuntimeError("adopt() is for a proxy with no replica yet (a restarted one)")
        for name, path in versions.items():
            self.book.publish(name, path)

    async def add(
        self, replica_id: str, url: str, loader: AdapterLoader, capacity: int | None = None
    ) -> None:
        """Register a healthy replica; it takes traffic once it has loaded every live adapter version.
        `capacity`: what the replica reported (None: learnt from its /server_info in the background)."""
        base, _ = await served_models(self.session, url)
        if self.base_models and base != self.base_models:
            raise ValueError(
                f"replica {replica_id} at {url} serves {base}, the others serve {self.base_models}"
            )
        replica = Replica(replica_id, url, loader, capacity=capacity)
        async with self._adapter_lock:
            earlier: set[str] = set()
            served = 0
            if replica_id in self.replicas:
                # Its generator actor died and Ray restarted it: a new server, maybe on another node. The
                # replica's record (requests routed, versions ever loaded) goes on across its lives.
                logger.warning("replica %s registers again at %s: it replaces the old one", replica_id, url)
                earlier, served = self.book.ever_loaded_on(replica_id), self.book.loads.served(replica_id)
                self._forget(replica_id)
            self.book.add_replica(replica_id, ever_loaded=earlier, served=served)
            self.book.loads.set_capacity(replica_id, capacity)
            if capacity is None:
                self.spawn(self._learn_capacity(replica))
            self.replicas[replica_id] = replica
            self.base_models = base
            try:
                self.book.begin_catch_up(replica_id)
                await self._catch_up(replica)
            except BaseException:
                self._forget(replica_id)
                raise
        logger.info(
            "replica %s at %s active (%d adapters)", replica_id, url, len(self.book.loaded_on(replica_id))
        )

    async def _learn_capacity(self, replica: Replica) -> None:
        await learn_capacity(self.session, replica)
        if self.replicas.get(replica.replica_id) is replica:  # neither gone nor replaced meanwhile
            self.book.loads.set_capacity(replica.replica_id, replica.capacity)

    async def _catch_up(self, replica: Replica) -> None:
        """Bring a catching-up replica to the proxy's state, then activate it. Runs under _adapter_lock.

        What it serves is read back first: a replica that restarted lost its adapters (and its cache),
        one that only missed health checks still has them, and a name is never reused for other weights,
        so a name it serves is the version we published.
        """
        rid = replica.replica_id
        _, served = await served_models(self.session, replica.url)
        for name in self.book.loaded_on(rid) - served:
            self.book.mark_unloaded(rid, name)
        for name in served & set(self.book.live_adapters()):
            self.book.mark_loaded(rid, name)
        self.table.forget_replica(rid)  # its prefix cache may be gone: no affinity claims on trust
        for name, path in self.book.live_adapters().items():
            if name not in self.book.loaded_on(rid):
                await load_with_retry(
                    replica.loader,
                    name,
                    path,
                    retry_s=self.config.load_retry_interval_s,
                    deadline_s=self.config.load_deadline_s,
                    give_up=asyncio.Event(),
                )
                self.book.mark_loaded(rid, name)
        for name in self.book.loaded_on(rid):
            if self.book.is_closed(name) and not self.book.in_flight(rid, name):
                self.spawn(self.adapters.unload_on(rid, name))  # closed while it was away
        await self.pausing.match(replica)
        self.book.activate(rid)

    async def _catch_up_again(self, replica: Replica) -> None:
        """An unhealthy replica answers again (the health watch says so): catch it up, or leave it
        unhealthy for the next round if that fails."""
        rid = replica.replica_id
        async with self._adapter_lock:
            if self.replicas.get(rid) is not replica or self.book.state(rid) is not ReplicaState.UNHEALTHY:
                return
            self.book.begin_catch_up(rid)
            try:
                await self._catch_up(replica)
            except Exception as e:
                self.health.mark_unhealthy(rid, f"catch-up failed: {type(e).__name__}: {e}")
                return
        # A warning like its leaving (Ray shows an actor's warnings, not its info): the operator sees both.
        logger.warning("replica %s back in routing: caught up", rid)

    # -- health (rl_cluster.proxy.health): the server's and dispatcher's way in -------------------------

    async def check_health(self) -> None:
        await self.health.check()

    def report_down(self, replica_id: str, reason: str) -> None:
        self.health.report_down(replica_id, reason)

    async def report_back(self, replica_id: str) -> None:
        await self.health.report_back(replica_id)

    async def replica_failed(self, failure: ReplicaFailed) -> bool:
        return await self.health.replica_failed(failure)

    async def wait_for_active(self) -> bool:
        return await self.health.wait_for_active()

    # -- leaving: draining -> gone ----------------------------------------------------------------------

    async def remove(self, replica_id: str, drain_timeout_s: float) -> None:
        """Stop routing to the replica, wait (bounded) for its in-flight requests, then forget it."""
        self.rejoins.removed.add(replica_id)  # for good: a late report from it must not register it again
        if replica_id not in self.replicas:
            raise KeyError(f"unknown replica {replica_id!r}")
        await self.drain(replica_id, drain_timeout_s)
        if self.book.in_flight(replica_id):
            logger.warning(
                "removing replica %s with %d requests still in flight",
                replica_id,
                self.book.in_flight(replica_id),
            )
        self._forget(replica_id)

    async def drain(self, replica_id: str, timeout_s: float) -> dict:
        """Take the replica out of routing for good and wait (bounded) until nothing is in flight on it.
        It stays registered (draining: no new requests, still paused and resumed with the others) until
        remove(), so its server can be stopped only after this returns. Idempotent. Returns
        {"in_flight_at_start", "in_flight_left", "drain_s"}: what the scale-in waited for."""
        if replica_id not in self.replicas:
            raise KeyError(f"unknown replica {replica_id!r}")
        start, at_start = time.monotonic(), self.book.in_flight(replica_id)
        self.book.drain(replica_id)
        deadline = start + timeout_s
        while self.book.in_flight(replica_id) and time.monotonic() < deadline:
            self._drained.clear()
            try:
                await asyncio.wait_for(self._drained.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        left = self.book.in_flight(replica_id) if replica_id in self.replicas else 0
        return {"in_flight_at_start": at_start, "in_flight_left": left, "drain_s": time.monotonic() - start}

    def _forget(self, replica_id: str) -> None:
        if self.replicas.pop(replica_id, None) is not None:
            self.book.remove_replica(replica_id)
            self.table.forget_replica(replica_id)

    # -- requests: what keeps a replica (and an adapter on it) busy -------------------------------------

    def begin_request(self, replica: Replica, adapter: str | None) -> None:
        self.book.begin(replica.replica_id, adapter or "")

    def end_request(self, replica: Replica, adapter: str | None) -> None:
        """The last request for a closed adapter unloads it there; a draining replica may now be empty."""
        # A replica removed, or replaced by its restarted actor's new server, took its counts with it.
        current = self.replicas.get(replica.replica_id) is replica
        if current and self.book.end(replica.replica_id, adapter or ""):
            self.spawn(self.adapters.unload_on(replica.replica_id, adapter or ""))
        self._drained.set()

    # -- broadcasts (rl_cluster.proxy.adapters, rl_cluster.proxy.pausing), detached from the caller -----

    async def load(self, name: str, path: str) -> list[str]:
        """Load `name` on every active replica, all-or-nothing; it is routable when this returns. Returns
        the replicas it went to. Raises AdapterExists, NoActiveReplica or broadcast.LoadFailed."""
        return await self._detached(self.adapters.load(name, path))

    async def close(self, name: str) -> bool:
        """Close `name` to new requests; each replica unloads it once nothing for it is in flight there.
        False when the name is unknown."""
        return await self.adapters.close(name)

    async def pause(self, query: str) -> dict[str, str]:
        """Pause every reachable replica, all-or-nothing; {replica: error} of failures (then all resumed)."""
        return await self._detached(self.pausing.pause(query))

    async def resume(self) -> dict[str, str]:
        return await self._detached(self.pausing.resume())


def replica_stats(pool: ReplicaPool) -> dict[str, dict]:
    """Per replica: url, state, requests routed, in flight, adapters loaded now and ever."""
    book = pool.book
    return {
        rid: {
            "url": replica.url,
            "state": str(book.state(rid)),
            "requests": book.loads.served(rid),
            "capacity": replica.capacity,
            "in_flight": book.in_flight(rid),
            "adapters_loaded": sorted(book.loaded_on(rid)),
            "adapters_ever_loaded": sorted(book.ever_loaded_on(rid)),
            "down_reason": pool.health.down_reasons.get(rid),  # why it last left routing, if it did
        }
        for rid, replica in sorted(pool.replicas.items())
    }
