"""The proxy: one HTTP server that looks like a single vLLM server, in front of N vLLM replicas.

Generation requests (/v1/completions, /v1/chat/completions) are checked (rl_cluster.proxy.validation),
then go to one replica, chosen by prefix affinity (rl_cluster.core.routing) among the active replicas that
have the requested adapter (rl_cluster.core.versions), and stream back unchanged. A replica that fails
before the client got a byte has the request retried on another one (at most once per replica).
Control requests (load/unload adapter, pause/resume) are broadcast to every replica, all-or-nothing.
A periodic health check takes failing replicas out of routing and brings them back through catch-up.
Its clients are TRL's AsyncGRPOTrainer (VLLMClient + the rollout worker) and any OpenAI client.

Two separate HTTP client sessions: generations (the data path) can be many and long, and while the
replicas are paused they do not return; control calls must never queue behind them, or a broadcast
/pause or /resume deadlocks (seen with a single bounded pool).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp
from aiohttp import web

from rl_cluster.config import ProxyConfig
from rl_cluster.core.routing import PrefixTable, block_hashes, choose_replica, request_prompt
from rl_cluster.core.versions import ReplicaState, VersionBook
from rl_cluster.errors import AdapterNotFound
from rl_cluster.proxy.broadcast import LoadFailed, load_everywhere, load_with_retry
from rl_cluster.proxy.control import CONTROL_TIMEOUT, HttpReplicaControl, ReplicaControl
from rl_cluster.proxy.forward import DATA_TIMEOUT, ReplicaFailed, forward
from rl_cluster.proxy.metrics import ROUTE_REASONS, LatencyHistogram, render_prometheus
from rl_cluster.proxy.pausing import PauseCoordinator
from rl_cluster.proxy.validation import (
    Invalid,
    check_adapter_name,
    check_adapter_path,
    check_generation,
    check_pause_query,
    parse_json_object,
)

logger = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
# Routes that change the replicas' state (or reveal the registry) need the bearer token when one is set.
CONTROL_ROUTES = frozenset(
    {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/pause", "/resume", "/replicas"}
)
INFO_TIMEOUT = aiohttp.ClientTimeout(total=30)
# Replicas that are reachable for broadcasts (pause/resume): every one but those known to be down.
REACHABLE = (ReplicaState.JOINING, ReplicaState.CATCHING_UP, ReplicaState.ACTIVE, ReplicaState.DRAINING)


@dataclass
class Replica:
    replica_id: str
    url: str
    control: ReplicaControl
    requests: int = 0


def error_response(
    status: int, message: str, err_type: str = "BadRequestError", param: str | None = None, **extra: Any
) -> web.Response:
    """An error in vLLM's (OpenAI's) JSON shape, so clients parse proxy errors like server errors."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}, **extra}
    return web.json_response(body, status=status)


def _reply(status: int, payload: Any) -> web.Response:
    """Pass on what a replica answered: JSON as JSON, anything else as text."""
    if isinstance(payload, str):
        return web.Response(status=status, text=payload)
    return web.json_response(payload, status=status)


class _Answer(Exception):
    """Raised while handling a request to answer it at once with `response` (caught by the middleware)."""

    def __init__(self, response: web.Response):
        self.response = response


class ProxyServer:
    """The proxy's HTTP server and replica registry. Runs on the caller's asyncio event loop.

    `adapter_root`: the bucket (a directory, or an s3:// URI) every `lora_path` must lie inside; None
    accepts any path (tests, or a proxy in front of servers that load from anywhere).
    """

    def __init__(self, config: ProxyConfig, adapter_root: str | None = None):
        self.config = config
        self.adapter_root = adapter_root
        self._book = VersionBook()
        self._table = PrefixTable(config.table_capacity)
        self._replicas: dict[str, Replica] = {}
        self._route_reasons: Counter[str] = Counter()
        self._retries = 0
        self._streams_broken = 0
        self.broadcast_latency = LatencyHistogram()
        self._base_models: list[str] = []  # learnt from the first replica's /v1/models
        # Serialises every change to the adapter set (load, unload, a replica catching up), so a joining
        # replica cannot miss a version that is being published while it catches up.
        self._adapter_lock = asyncio.Lock()
        # Pause/resume reach every replica but those known to be down (catch-up syncs them on return).
        self._pausing = PauseCoordinator(
            config.pause_lease_s,
            lambda: [self._replicas[r] for r in self._book.in_state(*REACHABLE)],
            self.broadcast_latency,
        )
        self._recovering: set[str] = set()
        self._background: set[asyncio.Task] = set()
        self._drained = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._data: aiohttp.ClientSession | None = None
        self._control: aiohttp.ClientSession | None = None
        self.url: str | None = None

    # -- lifecycle --------------------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and serve; returns the base URL (port 0 in the config picks a free port)."""
        # No connection limit on the data path: every in-flight generation holds a connection.
        self._data = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=DATA_TIMEOUT)
        self._control = aiohttp.ClientSession(timeout=CONTROL_TIMEOUT)
        self._pausing.session = self._control
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._middleware])
        app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/v1/models", self._models),
                web.get("/server_info", self._server_info),
                *(web.post(path, self._generate) for path in GENERATION_ROUTES),
                web.post("/v1/load_lora_adapter", self._load_adapter),
                web.post("/v1/unload_lora_adapter", self._unload_adapter),
                web.post("/pause", self._pause),
                web.post("/resume", self._resume),
                web.get("/replicas", self._replicas_route),
                web.get("/metrics", self._metrics),
            ]
        )
        # handler_cancellation: a client that hangs up cancels its forwarded generation, which closes the
        # upstream connection, which makes vLLM abort the request instead of computing it for nobody.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        self.url = f"http://{host}:{port}"
        self._spawn(self._watch_health())
        logger.info("proxy listening on %s", self.url)
        return self.url

    async def stop(self) -> None:
        """Stop serving. Replicas left paused are resumed first: a proxy must never leave them frozen."""
        await self._pausing.stop()
        for task in list(self._background):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        for session in (self._data, self._control):
            if session is not None:
                await session.close()
        self._runner = self._data = self._control = None

    def _spawn(self, coro: Coroutine) -> asyncio.Task:
        """A background task the proxy owns (kept referenced, cancelled at stop)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _detached(self, coro: Coroutine) -> Any:
        """Run a control operation to completion even if the HTTP client that asked for it hangs up:
        half a broadcast load or pause would leave the replicas inconsistent."""
        return await asyncio.shield(self._spawn(coro))

    # -- registry ---------------------------------------------------------------------------------------

    async def add_replica(self, replica_id: str, url: str, control: ReplicaControl | None = None) -> None:
        """Register a healthy replica; it takes traffic once it has loaded every live adapter version."""
        url = url.rstrip("/")
        base, _ = await self._served_models(url)
        if self._base_models and base != self._base_models:
            raise ValueError(
                f"replica {replica_id} at {url} serves {base}, the others serve {self._base_models}"
            )
        replica = Replica(replica_id, url, control or HttpReplicaControl(url, self._control))
        async with self._adapter_lock:
            self._book.add_replica(replica_id)
            self._replicas[replica_id] = replica
            self._base_models = base
            try:
                self._book.begin_catch_up(replica_id)
                await self._catch_up(replica)
            except BaseException:
                self._forget(replica_id)
                raise
        logger.info(
            "replica %s at %s active (%d adapters)", replica_id, url, len(self._book.loaded_on(replica_id))
        )

    async def remove_replica(self, replica_id: str, drain_timeout_s: float = 300.0) -> None:
        """Stop routing to the replica, wait (bounded) for its in-flight requests, then forget it."""
        if replica_id not in self._replicas:
            raise KeyError(f"unknown replica {replica_id!r}")
        self._book.drain(replica_id)
        deadline = time.monotonic() + drain_timeout_s
        while self._book.in_flight(replica_id) and time.monotonic() < deadline:
            self._drained.clear()
            try:
                await asyncio.wait_for(self._drained.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        if self._book.in_flight(replica_id):
            logger.warning(
                "removing replica %s with %d requests still in flight",
                replica_id,
                self._book.in_flight(replica_id),
            )
        self._forget(replica_id)

    def _forget(self, replica_id: str) -> None:
        if self._replicas.pop(replica_id, None) is not None:
            self._book.remove_replica(replica_id)
            self._table.forget_replica(replica_id)

    async def _served_models(self, url: str) -> tuple[list[str], set[str]]:
        """The base model ids and the adapter names a replica serves right now (its /v1/models)."""
        async with self._control.get(f"{url}/v1/models", timeout=INFO_TIMEOUT) as response:
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
        for name in self._book.loaded_on(rid) - served:
            self._book.mark_unloaded(rid, name)
        for name in served & set(self._book.live_adapters()):
            self._book.mark_loaded(rid, name)
        self._table.forget_replica(rid)  # its prefix cache may be gone: no affinity claims on trust
        for name, path in self._book.live_adapters().items():
            if name not in self._book.loaded_on(rid):
                await load_with_retry(
                    replica.control,
                    name,
                    path,
                    retry_s=self.config.load_retry_interval_s,
                    deadline_s=self.config.load_deadline_s,
                    give_up=asyncio.Event(),
                )
                self._book.mark_loaded(rid, name)
        for name in self._book.loaded_on(rid):
            if self._book.is_closed(name) and not self._book.in_flight(rid, name):
                self._spawn(self._unload_on(rid, name))  # closed while it was away
        await self._pausing.match(replica)
        self._book.activate(rid)

    # -- health -----------------------------------------------------------------------------------------

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_health()
            except Exception:
                logger.exception("health check round failed")

    async def check_health(self) -> None:
        """One round: active replicas that fail leave routing; unhealthy ones that answer catch up again."""
        watched = [
            self._replicas[r] for r in self._book.in_state(ReplicaState.ACTIVE, ReplicaState.UNHEALTHY)
        ]
        results = await asyncio.gather(*(self._probe(r) for r in watched))
        for replica, problem in zip(watched, results, strict=True):
            rid = replica.replica_id
            if self._replicas.get(rid) is not replica:
                continue  # removed (or replaced) meanwhile
            state = self._book.state(rid)
            if problem and state is ReplicaState.ACTIVE:
                self._mark_unhealthy(rid, f"health check failed: {problem}")
            elif not problem and state is ReplicaState.UNHEALTHY and rid not in self._recovering:
                self._recovering.add(rid)
                self._spawn(self._recover(replica))

    async def _probe(self, replica: Replica) -> str | None:
        """None when GET /health answers 200 within health_timeout_s, else what went wrong."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self._control.get(f"{replica.url}/health", timeout=timeout) as response:
                return None if response.status == 200 else f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            return f"{type(e).__name__}: {e}"

    def _mark_unhealthy(self, replica_id: str, reason: str) -> None:
        if self._book.mark_unhealthy(replica_id):
            logger.warning("replica %s left routing: %s", replica_id, reason)

    async def _recover(self, replica: Replica) -> None:
        rid = replica.replica_id
        try:
            async with self._adapter_lock:
                if (
                    self._replicas.get(rid) is not replica
                    or self._book.state(rid) is not ReplicaState.UNHEALTHY
                ):
                    return
                self._book.begin_catch_up(rid)
                try:
                    await self._catch_up(replica)
                except Exception as e:
                    self._mark_unhealthy(rid, f"catch-up failed: {type(e).__name__}: {e}")
                    return
            logger.info("replica %s recovered: active again", rid)
        finally:
            self._recovering.discard(rid)

    async def _replica_failed(self, failure: ReplicaFailed) -> bool:
        """After a failed generation: is the replica down? Down ones leave routing at once."""
        replica = self._replicas.get(failure.replica_id)
        if replica is None:
            return True
        problem = await self._probe(replica)
        if problem:
            self._mark_unhealthy(replica.replica_id, f"{failure}; health check: {problem}")
        return problem is not None

    def stats(self) -> dict:
        """Per replica: url, state, requests routed, in flight, adapters loaded now and ever; routing totals."""
        return {
            "replicas": {
                rid: {
                    "url": replica.url,
                    "state": str(self._book.state(rid)),
                    "requests": replica.requests,
                    "in_flight": self._book.in_flight(rid),
                    "adapters_loaded": sorted(self._book.loaded_on(rid)),
                    "adapters_ever_loaded": sorted(self._book.ever_loaded_on(rid)),
                }
                for rid, replica in sorted(self._replicas.items())
            },
            "routing": {reason: self._route_reasons[reason] for reason in ROUTE_REASONS},
            "retries": self._retries,
            "streams_broken": self._streams_broken,
            "adapters_routable": sorted(self._book.routable()),
            "base_models": list(self._base_models),
            "paused": self._pausing.paused,
        }

    # -- middleware and helpers -------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable]):
        token = self.config.auth_token
        if token and request.path in CONTROL_ROUTES:
            # surrogatepass: a header may decode to anything; garbage must compare unequal, not crash.
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogatepass")
            if not hmac.compare_digest(given, f"Bearer {token}".encode()):
                return error_response(401, "missing or wrong bearer token", "UnauthorizedError")
        try:
            return await handler(request)
        except _Answer as answer:
            return answer.response
        except Invalid as e:
            return error_response(400, str(e), param=e.param)

    async def _read_json(self, request: web.Request) -> tuple[bytes, dict]:
        """The request's raw body and its JSON object; a 413 or 400 answer when it is not one."""
        limit = self.config.max_body_bytes
        too_large = error_response(413, f"request body over {limit} bytes", "RequestTooLarge")
        if request.content_length is not None and request.content_length > limit:
            raise _Answer(too_large)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _Answer(too_large) from None
        return raw, parse_json_object(raw)

    async def _get_from_replica(self, path: str, query: str) -> tuple[int, Any]:
        """GET from the first active replica that answers (all active ones serve the same thing)."""
        failures = []
        for replica_id in self._book.active():
            url = f"{self._replicas[replica_id].url}{path}" + (f"?{query}" if query else "")
            try:
                async with self._control.get(url, timeout=INFO_TIMEOUT) as response:
                    if response.content_type == "application/json":
                        return response.status, await response.json()
                    return response.status, await response.text()
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                failures.append(f"{replica_id}: {type(e).__name__}: {e}")
        if failures:
            raise _Answer(error_response(502, f"no replica answered {path}: {failures}", "BadGatewayError"))
        raise _Answer(error_response(503, "no active replica", "ServiceUnavailableError"))

    # -- read-only routes -------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if self._book.active():
            return web.Response(status=200)
        return error_response(503, "no active replica", "ServiceUnavailableError")

    async def _models(self, request: web.Request) -> web.Response:
        status, payload = await self._get_from_replica("/v1/models", request.query_string)
        if status == 200 and isinstance(payload, dict) and isinstance(payload.get("data"), list):
            # One replica's list, minus adapters that are not routable through the proxy (yet or any more).
            routable = self._book.routable()
            payload["data"] = [
                m for m in payload["data"] if m["id"] in self._base_models or m["id"] in routable
            ]
        return _reply(status, payload)

    async def _server_info(self, request: web.Request) -> web.Response:
        status, payload = await self._get_from_replica("/server_info", request.query_string)
        config = payload.get("vllm_config") if isinstance(payload, dict) else None
        if isinstance(config, dict) and isinstance(config.get("parallel_config"), dict):
            # The proxy loads adapters on every replica, so to TRL it is one server without data parallelism
            # (TRL falls back to merged-weight syncs when it sees data_parallel_size > 1).
            config["parallel_config"]["data_parallel_size"] = 1
        return _reply(status, payload)

    async def _replicas_route(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _metrics(self, request: web.Request) -> web.Response:
        text = render_prometheus(self.stats(), self.broadcast_latency)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- generation -------------------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw, body = await self._read_json(request)
        check_generation(request.path, body, max_n=self.config.max_n)
        model = body.get("model")
        adapter = None if model is None or model in self._base_models else model
        hashes = block_hashes(adapter or "", request_prompt(body), self.config.block_size)
        tried: list[str] = []
        failure: ReplicaFailed | None = None
        # Bounded: each replica is tried at most once, and only after the previous one failed before
        # the client received anything (ReplicaFailed).
        while True:
            eligible = [r for r in self._book.eligible(adapter) if r not in tried]
            if not eligible:
                return self._no_replica_answer(model, adapter, failure)
            decision = choose_replica(
                hashes,
                self._table,
                {r: self._book.in_flight(r) for r in eligible},
                self.config.imbalance_threshold,
                served={r: self._replicas[r].requests for r in eligible},
                policy=self.config.routing_policy,
            )
            if tried:
                self._retries += 1
                logger.warning("retrying on replica %s after: %s", decision.replica_id, failure)
            else:
                self._route_reasons[decision.reason] += 1
            self._table.record(hashes, decision.replica_id)
            tried.append(decision.replica_id)
            try:
                return await self._forward_counted(request, self._replicas[decision.replica_id], raw, adapter)
            except ReplicaFailed as e:
                failure = e
                if not await self._replica_failed(e):
                    # A 5xx from a replica that is fine otherwise: the request's own problem, passed on.
                    return e.answer or error_response(502, str(e), "BadGatewayError")

    def _no_replica_answer(
        self, model: Any, adapter: str | None, failure: ReplicaFailed | None
    ) -> web.Response:
        if failure is not None:
            return failure.answer or error_response(
                502, f"every eligible replica failed; last: {failure}", "BadGatewayError"
            )
        if adapter is not None and not self._book.is_routable(adapter):
            # The same answer vLLM gives for a name it does not serve.
            aliases = ", ".join(self._base_models)
            message = f"The model `{model}` does not exist. Valid aliases: {aliases}."
            return error_response(404, message, "NotFoundError", "model")
        return error_response(503, "no active replica", "ServiceUnavailableError")

    async def _forward_counted(
        self, request: web.Request, replica: Replica, raw: bytes, adapter: str | None
    ) -> web.StreamResponse:
        """Forward one attempt, counted in flight on its replica for its adapter while it runs."""
        replica.requests += 1
        in_flight_key = adapter or ""
        self._book.begin(replica.replica_id, in_flight_key)
        try:
            response, broken = await forward(request, self._data, replica.replica_id, replica.url, raw)
        finally:
            if self._book.end(replica.replica_id, in_flight_key):
                self._spawn(self._unload_on(replica.replica_id, in_flight_key))
            self._drained.set()
        if broken is not None:
            self._streams_broken += 1
            logger.warning("stream from replica %s ended with an error: %s", replica.replica_id, broken)
            self._spawn(self._replica_failed(ReplicaFailed(replica.replica_id, broken)))
        return response

    # -- adapters ---------------------------------------------------------------------------------------

    async def _load_adapter(self, request: web.Request) -> web.Response:
        body = (await self._read_json(request))[1]
        if not isinstance(body.get("lora_name"), str) or not isinstance(body.get("lora_path"), str):
            return error_response(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        name = check_adapter_name(body["lora_name"])
        path = check_adapter_path(body["lora_path"], self.adapter_root)
        if body.get("load_inplace"):
            return error_response(
                400,
                "load_inplace is not supported by the proxy: publish new weights under a "
                "new name (vLLM keys its prefix cache by adapter name)",
                "InvalidUserInput",
            )
        if name in self._base_models:
            return error_response(
                400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput"
            )
        return await self._detached(self._load_everywhere(name, path))

    async def _load_everywhere(self, name: str, path: str) -> web.Response:
        async with self._adapter_lock:
            if self._book.known(name):
                return error_response(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to "
                    "load the adapter in place, set 'load_inplace' to True.",
                    "InvalidUserInput",
                )
            targets = self._book.active()
            if not targets:
                return error_response(503, "no active replica", "ServiceUnavailableError")
            start = time.monotonic()
            try:
                await load_everywhere(
                    name,
                    path,
                    {r: self._replicas[r].control for r in targets},
                    retry_s=self.config.load_retry_interval_s,
                    deadline_s=self.config.load_deadline_s,
                    # A replica removed meanwhile is not marked.
                    loaded=lambda r: self._book.mark_loaded(r, name) if r in self._replicas else None,
                    holders=lambda: self._book.holders(name),
                    unloaded=lambda r: self._book.mark_unloaded(r, name),
                )
            except LoadFailed as e:
                logger.error("%s", e)
                return error_response(
                    e.status,
                    str(e),
                    "AdapterLoadError",
                    replicas={r: str(err) for r, err in e.failures.items()},
                )
            finally:
                self.broadcast_latency.observe("load", time.monotonic() - start)
            self._book.publish(name, path)
        logger.info("adapter %s routable on %s", name, targets)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_adapter(self, request: web.Request) -> web.Response:
        body = (await self._read_json(request))[1]
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return error_response(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
            )
        async with self._adapter_lock:
            if not self._book.known(name):
                return error_response(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            if not self._book.is_closed(name):
                for replica_id in self._book.close(name):
                    self._spawn(self._unload_on(replica_id, name))
        # The name is closed to new requests now; replicas unload it as their in-flight requests finish.
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _unload_on(self, replica_id: str, name: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        start = time.monotonic()
        try:
            await replica.control.unload_adapter(name)
        except AdapterNotFound:
            pass  # already gone: the goal is reached
        except Exception:
            # Left marked as loaded (and closed): it still occupies a slot on that replica, and we say so.
            # An unhealthy replica retries this when it catches up.
            logger.exception("unloading adapter %s on replica %s failed", name, replica_id)
            return
        finally:
            self.broadcast_latency.observe("unload", time.monotonic() - start)
        self._book.mark_unloaded(replica_id, name)
        logger.info("adapter %s unloaded on replica %s", name, replica_id)

    # -- pause / resume ---------------------------------------------------------------------------------

    async def _pause(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        check_pause_query(query)
        return await self._detached(self._pause_everywhere(urlencode(query)))

    async def _resume(self, request: web.Request) -> web.Response:
        return await self._detached(self._resume_everywhere())

    async def _pause_everywhere(self, query: str) -> web.Response:
        failures = await self._pausing.pause(query)
        if failures:
            return error_response(
                502, f"pause failed on {sorted(failures)}; resumed all", "PauseError", replicas=failures
            )
        return web.json_response({"status": "paused"})

    async def _resume_everywhere(self) -> web.Response:
        failures = await self._pausing.resume()
        if failures:
            return error_response(
                502, f"resume failed on {sorted(failures)}", "ResumeError", replicas=failures
            )
        return web.json_response({"status": "resumed"})


# Import paths other modules use (rl_cluster.generator.actor imports HttpReplicaControl from here).
__all__ = [
    "HttpReplicaControl",
    "LoadFailed",
    "ProxyServer",
    "Replica",
    "ReplicaControl",
    "ReplicaFailed",
    "error_response",
]
