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

Adapter changes are broadcasts: a load goes to every active replica, all-or-nothing (rl_cluster.proxy.
broadcast), and becomes routable only when every one confirmed; an unload closes the name at once and
each replica unloads it when its last request for it ends. One lock serialises loads, closes and
catch-ups, so a replica that catches up cannot miss a version published meanwhile. Broadcasts run as
tasks the pool owns: a client that hangs up mid-broadcast must not leave the replicas half-changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from rl_cluster.config import ProxyConfig
from rl_cluster.core.routing import PrefixTable
from rl_cluster.core.versions import ReplicaState, VersionBook
from rl_cluster.errors import AdapterNotFound, ReplicaDown
from rl_cluster.proxy.adapter_loader import AdapterLoader
from rl_cluster.proxy.broadcast import LoadFailed, load_everywhere, load_with_retry
from rl_cluster.proxy.forward import ReplicaFailed
from rl_cluster.proxy.metrics import LatencyHistogram
from rl_cluster.proxy.pausing import PauseCoordinator

logger = logging.getLogger(__name__)

INFO_TIMEOUT = aiohttp.ClientTimeout(total=30)
# Replicas that are reachable for broadcasts (pause/resume): every one but those known to be down.
REACHABLE = (ReplicaState.JOINING, ReplicaState.CATCHING_UP, ReplicaState.ACTIVE, ReplicaState.DRAINING)


@dataclass
class Replica:
    replica_id: str
    url: str
    loader: AdapterLoader
    requests: int = 0
    capacity: int | None = None
    """Concurrent sequences it runs (vLLM max_num_seqs): routing compares loads relative to it. None
    until known (the replica reported none and its /server_info has not answered yet)."""


class AdapterExists(Exception):
    """A load of a name the proxy already knows: names are never reused for different weights."""


class NoActiveReplica(Exception):
    """Nothing to broadcast to: no replica is active."""


class ReplicaPool:
    """The registry (`replicas`, their states and adapters in `book`, their cached prefixes in `table`)
    and everything that changes it. Runs on the proxy's event loop; `start` hands it the admin session."""

    def __init__(self, config: ProxyConfig, latency: LatencyHistogram):
        self.config = config
        self.latency = latency
        self.book = VersionBook()
        self.table = PrefixTable(config.table_capacity)
        self.replicas: dict[str, Replica] = {}
        self.base_models: list[str] = []  # learnt from the first replica's /v1/models
        self.session: aiohttp.ClientSession | None = None
        self._adapter_lock = asyncio.Lock()
        # Pause/resume reach every replica but those known to be down (catch-up syncs them on return).
        self.pausing = PauseCoordinator(
            config.pause_lease_s,
            lambda: [self.replicas[r] for r in self.book.in_state(*REACHABLE)],
            latency,
        )
        self._recovering: set[str] = set()
        self._background: set[asyncio.Task] = set()
        self._drained = asyncio.Event()

    def start(self, session: aiohttp.ClientSession) -> None:
        """Use `session` for every admin call to a replica, and start watching their health."""
        self.session = self.pausing.session = session
        self.spawn(self._watch_health())

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

    async def add(
        self, replica_id: str, url: str, loader: AdapterLoader, capacity: int | None = None
    ) -> None:
        """Register a healthy replica; it takes traffic once it has loaded every live adapter version.
        `capacity`: what the replica reported (None: learnt from its /server_info in the background)."""
        base, _ = await self._served_models(url)
        if self.base_models and base != self.base_models:
            raise ValueError(
                f"replica {replica_id} at {url} serves {base}, the others serve {self.base_models}"
            )
        replica = Replica(replica_id, url, loader, capacity=capacity)
        if capacity is None:
            self.spawn(self._learn_capacity(replica))
        async with self._adapter_lock:
            if replica_id in self.replicas:
                # Its generator actor died and Ray restarted it: a new server, maybe on another node.
                logger.warning("replica %s registers again at %s: it replaces the old one", replica_id, url)
                self._forget(replica_id)
            self.book.add_replica(replica_id)
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
        """Ask vLLM for its max_num_seqs. In the background: vLLM builds /server_info's environment
        report on first use (~2 s here), and registration must not wait for it; until then the replica
        counts as the smallest one known."""
        url = f"{replica.url}/server_info?config_format=json"
        try:
            async with self.session.get(url, timeout=INFO_TIMEOUT) as response:
                response.raise_for_status()
                info = await response.json()
            replica.capacity = int(info["vllm_config"]["scheduler_config"]["max_num_seqs"])
            logger.info("replica %s runs up to %d sequences at once", replica.replica_id, replica.capacity)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as e:
            logger.warning("capacity of replica %s unknown (%s: %s)", replica.replica_id, type(e).__name__, e)

    async def _served_models(self, url: str) -> tuple[list[str], set[str]]:
        """The base model ids and the adapter names a replica serves right now (its /v1/models)."""
        async with self.session.get(f"{url}/v1/models", timeout=INFO_TIMEOUT) as response:
            response.raise_for_status()
            models = (await response.json())["data"]
        base = [m["id"] for m in models if not m.get("parent")]
        return base, {m["id"] for m in models if m.get("parent")}

    async def _catch_up(self, replica: Replica) -> None:
        """Bring a catching-up replica to the proxy's state, then activate it. Runs under _adapter_lock.

        What it serves is read back first: a replica that restarted lost its adapters (and its cache),
        one that only missed health checks still has them, and a name is never reused for other weights,
        so a name it serves is the version we published.
        """
        rid = replica.replica_id
        _, served = await self._served_models(replica.url)
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
                self.spawn(self._unload_on(rid, name))  # closed while it was away
        await self.pausing.match(replica)
        self.book.activate(rid)

    # -- health: active -> unhealthy -> catching up -> active -------------------------------------------

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_health()
            except Exception:
                logger.exception("health check round failed")

    async def check_health(self) -> None:
        """One round: active replicas that fail leave routing; unhealthy ones that answer catch up again."""
        watched = [self.replicas[r] for r in self.book.in_state(ReplicaState.ACTIVE, ReplicaState.UNHEALTHY)]
        results = await asyncio.gather(*(self._probe(r) for r in watched))
        for replica, problem in zip(watched, results, strict=True):
            rid = replica.replica_id
            if self.replicas.get(rid) is not replica:
                continue  # removed (or replaced) meanwhile
            state = self.book.state(rid)
            if problem and state is ReplicaState.ACTIVE:
                self._mark_unhealthy(rid, f"health check failed: {problem}")
            elif not problem and state is ReplicaState.UNHEALTHY and rid not in self._recovering:
                self._recovering.add(rid)
                self.spawn(self._recover(replica))

    async def _probe(self, replica: Replica) -> str | None:
        """None when GET /health answers 200 within health_timeout_s, else what went wrong."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self.session.get(f"{replica.url}/health", timeout=timeout) as response:
                return None if response.status == 200 else f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            return f"{type(e).__name__}: {e}"

    def _mark_unhealthy(self, replica_id: str, reason: str) -> None:
        if self.book.mark_unhealthy(replica_id):
            logger.warning("replica %s left routing: %s", replica_id, reason)

    def report_down(self, replica_id: str, reason: str) -> None:
        if replica_id in self.replicas:
            self._mark_unhealthy(replica_id, reason)

    async def report_back(self, replica_id: str) -> None:
        """Catch a restarted replica up now (a restart can be quicker than the health-check interval, and
        the new server holds none of the adapters the book says it has)."""
        replica = self.replicas.get(replica_id)
        if replica is None or replica_id in self._recovering:
            return  # gone, or a health check already found the new server and is catching it up
        self._mark_unhealthy(replica_id, "its server was restarted")
        self._recovering.add(replica_id)
        await self._recover(replica)

    async def _down(self, replica_id: str, error: BaseException) -> bool:
        """During a broadcast: is the replica that failed it down? Then it leaves routing (and catches up
        when it is back) instead of failing the broadcast for the replicas that are fine."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            problem = "removed"
        elif isinstance(error, ReplicaDown):  # its actor says so; its old server may linger a few seconds
            problem = "no server"
        else:
            problem = await self._probe(replica)
        if problem and replica is not None:
            self._mark_unhealthy(replica_id, f"{type(error).__name__}: {error}; health check: {problem}")
        return problem is not None

    async def replica_failed(self, failure: ReplicaFailed) -> bool:
        """After a failed generation: is the replica down? Down ones leave routing at once."""
        replica = self.replicas.get(failure.replica_id)
        if replica is None:
            return True
        problem = await self._probe(replica)
        if problem:
            self._mark_unhealthy(replica.replica_id, f"{failure}; health check: {problem}")
        return problem is not None

    async def _recover(self, replica: Replica) -> None:
        rid = replica.replica_id
        try:
            async with self._adapter_lock:
                if (
                    self.replicas.get(rid) is not replica
                    or self.book.state(rid) is not ReplicaState.UNHEALTHY
                ):
                    return
                self.book.begin_catch_up(rid)
                try:
                    await self._catch_up(replica)
                except Exception as e:
                    self._mark_unhealthy(rid, f"catch-up failed: {type(e).__name__}: {e}")
                    return
            logger.info("replica %s recovered: active again", rid)
        finally:
            self._recovering.discard(rid)

    # -- leaving: draining -> gone ----------------------------------------------------------------------

    async def remove(self, replica_id: str, drain_timeout_s: float) -> None:
        """Stop routing to the replica, wait (bounded) for its in-flight requests, then forget it."""
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
        replica.requests += 1
        self.book.begin(replica.replica_id, adapter or "")

    def end_request(self, replica: Replica, adapter: str | None) -> None:
        """The last request for a closed adapter unloads it there; a draining replica may now be empty."""
        # A replica removed, or replaced by its restarted actor's new server, took its counts with it.
        current = self.replicas.get(replica.replica_id) is replica
        if current and self.book.end(replica.replica_id, adapter or ""):
            self.spawn(self._unload_on(replica.replica_id, adapter or ""))
        self._drained.set()

    # -- adapter broadcasts -----------------------------------------------------------------------------

    async def load(self, name: str, path: str) -> list[str]:
        """Load `name` on every active replica, all-or-nothing; it is routable when this returns. Returns
        the replicas it went to. Raises AdapterExists, NoActiveReplica or broadcast.LoadFailed."""
        return await self._detached(self._load(name, path))

    async def wait_for_active(self) -> bool:
        """True once a replica is active; False when none was for proxy.unavailable_timeout_s. A replica
        that is down comes back by itself (its actor restarts it), so requests wait for it rather than
        fail the run at once."""
        deadline = time.monotonic() + self.config.unavailable_timeout_s
        while not self.book.active():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.25)
        return True

    async def _load(self, name: str, path: str) -> list[str]:
        deadline = time.monotonic() + self.config.unavailable_timeout_s
        while True:
            try:
                targets = await self._load_once(name, path)
                break
            except LoadFailed as e:
                # Every replica it went to turned out to be down (a one-replica run whose engine just
                # died): like a request, the sync waits for one to come back, bounded.
                if not e.all_down or time.monotonic() >= deadline:
                    raise
                logger.warning("every replica was down while loading %s: waiting for one to return", name)
        routable_on = [r for r in targets if name in self.book.loaded_on(r)]
        logger.info("adapter %s routable on %s", name, routable_on)
        return routable_on

    async def _load_once(self, name: str, path: str) -> list[str]:
        """One all-or-nothing load over the replicas active now; returns them (raises as `load`)."""
        # Outside the lock: a returning replica's catch-up takes it before the replica is active.
        await self.wait_for_active()
        async with self._adapter_lock:
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
                    down=self._down,
                )
            finally:
                self.latency.observe("load", time.monotonic() - start)
            self.book.publish(name, path)
        return targets

    async def close(self, name: str) -> bool:
        """Close `name` to new requests; each replica unloads it once nothing for it is in flight there.
        False when the name is unknown."""
        async with self._adapter_lock:
            if not self.book.known(name):
                return False
            if not self.book.is_closed(name):
                for replica_id in self.book.close(name):
                    self.spawn(self._unload_on(replica_id, name))
        return True

    async def _unload_on(self, replica_id: str, name: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None:
            return
        start = time.monotonic()
        try:
            await replica.loader.unload_adapter(name)
        except AdapterNotFound:
            pass  # already gone: the goal is reached
        except Exception:
            # Left marked as loaded (and closed): it still occupies a slot on that replica, and we say so.
            # An unhealthy replica retries this when it catches up.
            logger.exception("unloading adapter %s on replica %s failed", name, replica_id)
            return
        finally:
            self.latency.observe("unload", time.monotonic() - start)
        self.book.mark_unloaded(replica_id, name)
        logger.info("adapter %s unloaded on replica %s", name, replica_id)

    async def pause(self, query: str) -> dict[str, str]:
        """Pause every reachable replica, all-or-nothing; {replica: error} of failures (then all resumed)."""
        return await self._detached(self.pausing.pause(query))

    async def resume(self) -> dict[str, str]:
        return await self._detached(self.pausing.resume())

    # -- what it looks like -----------------------------------------------------------------------------

    def replica_stats(self) -> dict[str, dict]:
        """Per replica: url, state, requests routed, in flight, adapters loaded now and ever."""
        return {
            rid: {
                "url": replica.url,
                "state": str(self.book.state(rid)),
                "requests": replica.requests,
                "capacity": replica.capacity,
                "in_flight": self.book.in_flight(rid),
                "adapters_loaded": sorted(self.book.loaded_on(rid)),
                "adapters_ever_loaded": sorted(self.book.ever_loaded_on(rid)),
            }
            for rid, replica in sorted(self.replicas.items())
        }
