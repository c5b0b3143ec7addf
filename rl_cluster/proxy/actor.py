"""The proxy as a Ray actor: one ProxyServer serving HTTP on the actor's own event loop.

An async actor (its methods are coroutines), so the aiohttp server and the method calls share one loop;
inside these coroutines we `await`, never `ray.get`, which would block that loop and the proxy with it.
It also exports the proxy's metrics through ray.util.metrics, for the Ray dashboard.
"""

from __future__ import annotations

import asyncio
import logging

import ray

from rl_cluster.config import ProxyConfig
from rl_cluster.proxy.ray_metrics import EXPORT_INTERVAL_S, RayMetrics
from rl_cluster.proxy.server import ProxyServer, ReplicaControl

logger = logging.getLogger(__name__)


@ray.remote
class ProxyActor:
    def __init__(self, config: ProxyConfig, adapter_root: str | None = None):
        """`adapter_root`: the bucket every loaded adapter path must lie inside (None: any path)."""
        self._server = ProxyServer(config, adapter_root)
        self._metrics = RayMetrics()
        self._server.broadcast_latency.listeners.append(self._metrics.observe_broadcast)
        self._exporter: asyncio.Task | None = None

    async def start(self) -> str:
        """Start serving; returns the proxy's base URL."""
        url = await self._server.start()
        self._exporter = asyncio.get_running_loop().create_task(self._export_metrics())
        return url

    async def _export_metrics(self) -> None:
        while True:
            try:
                self._metrics.update(self._server.stats())
            except Exception:
                logger.exception("exporting proxy metrics to Ray failed")
            await asyncio.sleep(EXPORT_INTERVAL_S)

    async def add_replica(self, replica_id: str, url: str, control: ReplicaControl | None = None) -> None:
        await self._server.add_replica(replica_id, url, control)

    async def remove_replica(self, replica_id: str, drain_timeout_s: float = 300.0) -> None:
        await self._server.remove_replica(replica_id, drain_timeout_s)

    async def stats(self) -> dict:
        return self._server.stats()

    async def stop(self) -> None:
        if self._exporter is not None:
            self._exporter.cancel()
        await self._server.stop()
