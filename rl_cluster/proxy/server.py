"""The proxy: one HTTP server that looks like a single vLLM server, in front of N vLLM replicas.

This module is the HTTP layer: it parses and checks requests (rl_cluster.proxy.validation), hands them
on, and answers in vLLM's shapes. Generations go to rl_cluster.proxy.dispatch (one replica, chosen by
prefix affinity, retried elsewhere if it fails early); the control routes (adapter loads and unloads,
pause and resume) are rl_cluster.proxy.control's; the replicas' whole life (joining, catching up, health,
draining) belongs to rl_cluster.proxy.replicas and the parts it is made of (health, adapters, pausing).
Its clients are TRL's AsyncGRPOTrainer (VLLMClient + the rollout worker) and any OpenAI client.

Two separate HTTP client sessions to the replicas: generations (the data session) can be many and
long, and while the replicas are paused they do not return; admin calls (adapters, pause, resume,
health, model lists) must never queue behind them, or a broadcast /pause or /resume deadlocks (seen
with a single bounded pool).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from rl_cluster.config import ProxyConfig
from rl_cluster.core.auth import bearer_headers
from rl_cluster.generator.vllm_compat import CLIENT_KEEPALIVE_S
from rl_cluster.nodes import stable_port
from rl_cluster.proxy.adapter_loader import ADMIN_TIMEOUT, AdapterLoader, HttpAdapterLoader
from rl_cluster.proxy.answers import Answer, error_response, no_active_replica, read_json, reply
from rl_cluster.proxy.control import ControlRoutes
from rl_cluster.proxy.dispatch import Dispatcher
from rl_cluster.proxy.forward import data_timeout
from rl_cluster.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from rl_cluster.proxy.replicas import INFO_TIMEOUT, Member, ReplicaPool, replica_stats
from rl_cluster.proxy.validation import (
    Invalid,
    check_generation,
)

logger = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
# With a token set, every route but these needs it: generation spends the replicas, /v1/models and
# /server_info show what they serve, the control routes change it. Probes and scrapers stay open.
OPEN_ROUTES = frozenset({"/health", "/metrics"})


class ProxyServer:
    """The proxy's HTTP server. Runs on the caller's asyncio event loop.

    `adapter_root`: the bucket (a directory, or an s3:// URI) every `lora_path` must lie inside; None
    accepts any path (tests, or a proxy in front of servers that load from anywhere).
    `replica_key`: the run's secret the replicas were started with (vLLM `--api-key`); sent on every
    call to a replica, never forwarded from or shown to clients. None: replicas without a key.
    `max_model_len`: the context the replicas serve (model.max_model_len); requests that cannot fit it are
    refused here. None: not checked (left to the replicas).
    `find`: asks a replica's generator where it serves (None while it has no server), for a replica the
    proxy could not reach or does not know (ReplicaPool.rejoin). None: such a replica waits until it
    registers itself.
    """

    def __init__(
        self,
        config: ProxyConfig,
        adapter_root: str | None = None,
        replica_key: str | None = None,
        max_model_len: int | None = None,
        find: Callable[[str], Awaitable[Member | None]] | None = None,
    ):
        self.config = config
        self.adapter_root = adapter_root
        self.max_model_len = max_model_len
        self._replica_headers = bearer_headers(replica_key)
        self.metrics = ProxyMetrics(self.stats)
        self.broadcast_latency = self.metrics.broadcast_latency
        self._pool = ReplicaPool(config, self.broadcast_latency)
        self._pool.rejoins.find = find
        self._dispatch = Dispatcher(config, self._pool)
        self._control = ControlRoutes(config, self._pool, adapter_root)
        self._runner: web.AppRunner | None = None
        self._data_session: aiohttp.ClientSession | None = None
        self._admin_session: aiohttp.ClientSession | None = None
        self.url: str | None = None

    # -- lifecycle --------------------------------------------------------------------------------------

    async def start(self, port: int | None = None) -> str:
        """Bind and serve; returns the base URL. `port`: where to bind (None: the configured port, where 0
        picks a free one); a restarted proxy binds the port its predecessor had, where clients look."""
        # No connection limit on the data path: every in-flight generation holds a connection.
        # Both sessions carry the replicas' key: every route of a replica demands it.
        self._data_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S),  # vllm_compat 4
            timeout=data_timeout(self.config.pause_lease_s, self.max_model_len, self.config.read_timeout_s),
            headers=self._replica_headers,
        )
        self._admin_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(keepalive_timeout=CLIENT_KEEPALIVE_S),
            timeout=ADMIN_TIMEOUT,
            headers=self._replica_headers,
        )
        self._dispatch.session = self._data_session
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._middleware])
        app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/v1/models", self._models),
                web.get("/server_info", self._server_info),
                *(web.post(path, self._generate) for path in GENERATION_ROUTES),
                *self._control.routes(),  # adapters, pause, resume (rl_cluster.proxy.control)
                web.get("/replicas", self._replicas_route),
                web.get("/metrics", self._metrics),
            ]
        )
        # handler_cancellation: a client that hangs up cancels its forwarded generation, which closes the
        # upstream connection, which makes vLLM abort the request instead of computing it for nobody.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        bind = self.config.host or "127.0.0.1"  # unset: loopback (ProxyActor picks the node's address)
        port = port if port is not None else self.config.port
        # A port it may be restarted on (rl_cluster.nodes.stable_port).
        site = web.TCPSite(self._runner, bind, port or stable_port(bind))
        try:
            await site.start()
        except BaseException:  # the port is taken: nothing of this try may stay open (a restore retries)
            await self.stop()
            raise
        port = self._runner.addresses[0][1]
        host = bind if ":" not in bind else f"[{bind}]"
        self.url = f"http://{host}:{port}"
        self._pool.start(self._admin_session)
        logger.info("proxy listening on %s", self.url)
        return self.url

    async def stop(self) -> None:
        """Stop serving. Replicas left paused are resumed first: a proxy must never leave them frozen."""
        await self._pool.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        for session in (self._data_session, self._admin_session):
            if session is not None:
                await session.close()
        self._runner = self._data_session = self._admin_session = None

    # -- the replica pool, for the ProxyActor and tests -------------------------------------------------

    async def add_replica(
        self, replica_id: str, url: str, control: AdapterLoader | None = None, capacity: int | None = None
    ) -> None:
        """Register a healthy replica; it takes traffic once it has loaded every live adapter version.
        `control` loads adapters on it (None: straight through its vLLM HTTP routes). `capacity`: the
        sequences it runs at once (None: the proxy asks its vLLM server)."""
        url = url.rstrip("/")
        await self._pool.add(replica_id, url, self._loader(Member(url, control, capacity, {})), capacity)

    def _loader(self, member: Member) -> AdapterLoader:
        return member.control or HttpAdapterLoader(member.url.rstrip("/"), self._admin_session)

    async def restore(self, members: dict[str, Member], unreached: dict[str, str] | None = None) -> None:
        """Rebuild a restarted proxy's state from the replicas it had: `members` is replica id -> Member
        (url, control, capacity, held), `held` the adapter versions the replica serves and the bucket
        paths they came from. Every version some replica holds becomes routable again (loaded on the others
        by their catch-up: a version whose broadcast the old proxy did not finish is completed, not lost);
        each replica catches up (and is resumed) before it serves. One that cannot (its server is
        mid-restart), and each of `unreached` (replica id -> why its generator did not answer), is
        registered down: the health watch takes it back when it answers."""
        members = {rid: Member(*m) for rid, m in members.items()}
        self._pool.adopt({name: path for m in members.values() for name, path in m.held.items()})
        for replica_id, why in (unreached or {}).items():
            self._pool.rejoins.register_down(replica_id, f"did not answer the proxy's restore: {why}")
        await asyncio.gather(
            *(self._pool.rejoins.admit(rid, m._replace(url=m.url.rstrip("/"), control=self._loader(m)))
              for rid, m in members.items())
        )  # fmt: skip

    async def remove_replica(self, replica_id: str, drain_timeout_s: float = 300.0) -> None:
        """Stop routing to the replica, wait (bounded) for its in-flight requests, then forget it."""
        await self._pool.remove(replica_id, drain_timeout_s)

    def report_down(self, replica_id: str, reason: str) -> None:
        """The replica's own supervisor saw its server die: out of routing now, not at the next check."""
        self._pool.report_down(replica_id, reason)

    async def report_back(self, replica_id: str) -> None:
        """The replica's server was restarted: reload every live version on it, then route to it again.
        One the proxy does not know (or knows only by name) is registered (ReplicaPool.rejoin)."""
        await self._pool.report_back(replica_id)

    async def check_health(self) -> None:
        """One round: active replicas that fail leave routing; unhealthy ones that answer catch up again."""
        await self._pool.check_health()

    def stats(self) -> dict:
        """Per replica: url, state, requests routed, in flight, adapters loaded now and ever; routing totals."""
        book = self._pool.book
        return {
            "replicas": replica_stats(self._pool),
            **self._dispatch.stats(),  # routing, retries, streams_broken
            "adapters_routable": sorted(book.routable()),
            "base_models": list(self._pool.base_models),
            "paused": self._pool.pausing.paused,
        }

    # -- middleware and helpers -------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable]):
        token = self.config.auth_token
        if token and request.path not in OPEN_ROUTES:
            # surrogatepass: a header may decode to anything; garbage must compare unequal, not crash.
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogatepass")
            if not hmac.compare_digest(given, f"Bearer {token.get_secret_value()}".encode()):
                return error_response(401, "missing or wrong bearer token", "UnauthorizedError")
        try:
            return await handler(request)
        except Answer as answer:
            return answer.response
        except Invalid as e:
            return error_response(400, str(e), param=e.param)

    async def _get_from_replica(self, path: str, query: str) -> tuple[int, Any]:
        """GET from the first active replica that answers (all active ones serve the same thing)."""
        failures = []
        for replica_id in self._pool.book.active():
            url = f"{self._pool.replicas[replica_id].url}{path}" + (f"?{query}" if query else "")
            try:
                async with self._admin_session.get(url, timeout=INFO_TIMEOUT) as response:
                    if response.content_type == "application/json":
                        return response.status, await response.json()
                    return response.status, await response.text()
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                failures.append(f"{replica_id}: {type(e).__name__}: {e}")
        if failures:
            raise Answer(error_response(502, f"no replica answered {path}: {failures}", "BadGatewayError"))
        raise Answer(no_active_replica())

    # -- read-only routes -------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if self._pool.book.active():
            return web.Response(status=200)
        return no_active_replica()

    async def _models(self, request: web.Request) -> web.Response:
        status, payload = await self._get_from_replica("/v1/models", request.query_string)
        if status == 200 and isinstance(payload, dict) and isinstance(payload.get("data"), list):
            # One replica's list, minus adapters that are not routable through the proxy (yet or any more).
            routable, base = self._pool.book.routable(), self._pool.base_models
            payload["data"] = [m for m in payload["data"] if m["id"] in base or m["id"] in routable]
        return reply(status, payload)

    async def _server_info(self, request: web.Request) -> web.Response:
        status, payload = await self._get_from_replica("/server_info", request.query_string)
        config = payload.get("vllm_config") if isinstance(payload, dict) else None
        if isinstance(config, dict) and isinstance(config.get("parallel_config"), dict):
            # The proxy loads adapters on every replica, so to TRL it is one server without data parallelism
            # (TRL falls back to merged-weight syncs when it sees data_parallel_size > 1).
            config["parallel_config"]["data_parallel_size"] = 1
        return reply(status, payload)

    async def _replicas_route(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # -- generation -------------------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw, body = await read_json(request, self.config.max_body_bytes)
        config = self.config
        max_events = check_generation(
            request.path,
            body,
            max_n=config.max_n,
            max_sequences=config.max_sequences_per_request,
            max_model_len=self.max_model_len,
        )
        return await self._dispatch.generate(request, raw, body, max_events)
