"""The proxy as a Ray actor: one ProxyServer serving HTTP on the actor's own event loop.

An async actor (its methods are coroutines), so the aiohttp server and the method calls share one loop;
inside these coroutines we `await`, never `ray.get`, which would block that loop and the proxy with it.
It also exports the proxy's metrics through ray.util.metrics, for the Ray dashboard.
"""

from __future__ import annotations

import asyncio
import logging

import ray
from pydantic import SecretStr

from rl_cluster.config import ProxyConfig
from rl_cluster.core.names import NAMESPACE, generator_actor_name
from rl_cluster.nodes import node_placement
from rl_cluster.proxy.adapter_loader import AdapterLoader
from rl_cluster.proxy.heap import freeze_startup_heap
from rl_cluster.proxy.ray_metrics import EXPORT_INTERVAL_S, RayMetrics
from rl_cluster.proxy.replica import Member
from rl_cluster.proxy.server import ProxyServer

logger = logging.getLogger(__name__)


@ray.remote
class ProxyActor:
    def __init__(
        self,
        config: ProxyConfig,
        adapter_root: str | None = None,
        replica_key: str | None = None,
        auth_token: str | None = None,
        loopback: bool = True,
        run_name: str | None = None,
        max_model_len: int | None = None,
    ):
        """`adapter_root`: the bucket every loaded adapter path must lie inside (None: any path).
        `replica_key`: what the replicas demand; `auth_token`: what the control routes demand (None: the
        configured one). `loopback`: bind 127.0.0.1 when `config.host` is unset (a private local Ray),
        else this node's address, where the trainer and operators on other nodes reach it. `run_name`: the
        `run` tag of the proxy's Ray metrics, and how it finds a generator by name (None: it does not).
        `max_model_len`: the replicas' context, which bounds requests (None: not checked)."""
        host = config.host or ("127.0.0.1" if loopback else ray.util.get_node_ip_address())
        token = SecretStr(auth_token) if auth_token else config.auth_token
        resolved = config.model_copy(update={"host": host, "auth_token": token})
        self.run_name = run_name
        find = self._find_generator if run_name else None
        self._server = ProxyServer(resolved, adapter_root, replica_key, max_model_len, find=find)
        self._metrics = RayMetrics(run_name=run_name)
        self._server.broadcast_latency.listeners.append(self._metrics.observe_broadcast)
        self._exporter: asyncio.Task | None = None
        # False until start(). The run's launch starts the first one; one that Ray restarted after its
        # process died (proxy.max_restarts) serves nothing until the run's pool controller, which alone
        # knows the generators, restores it (`restore`).
        self.serving = False
        # Set once it takes registrations: at start, or for one Ray restarted, once restored.
        self._open = asyncio.Event()
        self.url: str | None = None  # where it serves, once it does
        self._restoring = asyncio.Lock()

    async def start(self, port: int | None = None, restoring: bool = False) -> str:
        """Start serving; returns the proxy's base URL. `port`: bind this one (a restarted proxy takes
        its predecessor's, where the clients look), else the configured one. `restoring`: generators that
        register wait until `restore` is done with what their predecessor held."""
        url = self.url = await self._server.start(port)
        self.serving = True
        if not restoring:
            self._open.set()
        freeze_startup_heap()  # this process serves the proxy alone: its collector may be tuned for it
        self._exporter = asyncio.get_running_loop().create_task(self._export_metrics())
        return url

    async def _export_metrics(self) -> None:
        while True:
            try:
                self._metrics.update(self._server.stats())
            except Exception:
                logger.exception("exporting proxy metrics to Ray failed")
            await asyncio.sleep(EXPORT_INTERVAL_S)

    async def _until_open(self) -> None:
        """A generator that registers (or reports back) with a proxy Ray restarted waits until the pool
        controller restored it (restore no longer waits for scale-outs, so this can happen), bounded."""
        wait_s = self._server.config.unavailable_timeout_s
        try:
            await asyncio.wait_for(self._open.wait(), wait_s)
        except TimeoutError:
            raise RuntimeError(
                f"the proxy was restarted by Ray and not restored within {wait_s:g} s"
            ) from None

    async def _find_generator(self, replica_id: str) -> Member | None:
        """Where the replica serves, asked of its generator actor, found by name in this run."""
        name = generator_actor_name(self.run_name, replica_id)
        actor = await asyncio.to_thread(ray.get_actor, name, NAMESPACE)  # a GCS lookup: off the event loop
        answer = await actor.membership.remote()
        return None if answer is None else Member(*answer)

    async def address(self) -> str | None:
        """Where it serves, once it takes requests (None before: a proxy Ray restarted and the pool
        controller has not restored yet). Ray restarts a proxy whose node was lost on another node with a
        `proxy` resource, at that node's address: the trainer asks this, through its handle, to follow it."""
        return self.url if self._open.is_set() else None

    async def add_replica(
        self, replica_id: str, url: str, control: AdapterLoader | None = None, capacity: int | None = None
    ) -> None:
        await self._until_open()
        await self._server.add_replica(replica_id, url, control, capacity)

    async def awaiting_restore(self) -> bool:
        """True while it does not serve: once the run launched, that is a proxy Ray restarted, which the
        pool controller (started after the launch) restores."""
        return not self.serving

    async def restore(
        self, port: int, members: dict[str, Member], unreached: dict[str, str] | None = None
    ) -> str:
        """Serve again on `port` and take the replicas back, each with what it holds (ProxyServer.restore);
        returns the URL. `members`: replica id -> its generator's membership; `unreached`: replica id ->
        why its generator did not answer (registered down, taken back when it answers). One at a time: a
        second one (a call retried, a second caller) finds it serving and changes nothing."""
        async with self._restoring:
            if self.serving:
                return self.url
            url = await self.start(port, restoring=True)
            logger.warning(
                "proxy restarted by Ray: serving again on %s, restoring %d replicas (%d unreached)",
                url, len(members), len(unreached or {}),
            )  # fmt: skip
            try:
                await self._server.restore(members, unreached)
            finally:
                self._open.set()
            return url

    async def remove_replica(self, replica_id: str, drain_timeout_s: float = 300.0) -> None:
        await self._server.remove_replica(replica_id, drain_timeout_s)

    async def report_down(self, replica_id: str, reason: str) -> None:
        self._server.report_down(replica_id, reason)

    async def report_back(self, replica_id: str) -> None:
        await self._until_open()
        await self._server.report_back(replica_id)

    async def placement(self) -> dict:
        return node_placement()

    async def stats(self) -> dict:
        """ProxyServer.stats, and `serving` (False: Ray restarted this proxy and it awaits its restore)."""
        return {**self._server.stats(), "serving": self.serving}

    async def stop(self) -> None:
        if self._exporter is not None:
            self._exporter.cancel()
        await self._server.stop()

    async def drain_replica(self, replica_id: str, timeout_s: float = 300.0) -> dict:
        """Scale-in, first half: no new requests for the replica, wait (bounded) for its in-flight ones.
        It stays registered until remove_replica (its generator's shutdown); see ReplicaPool.drain."""
        # Straight to the pool: the HTTP layer has no drain route, and an operator scales through the
        # pool controller (rl_cluster.pool), never by calling the proxy.
        return await self._server._pool.drain(replica_id, timeout_s)
