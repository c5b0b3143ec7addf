"""The proxy's control routes, as vLLM answers them: adapter loads and unloads (broadcast to every
replica by rl_cluster.proxy.replicas), and pause and resume of every replica. With proxy.auth_token set,
the server's middleware lets only the run's token through."""

from __future__ import annotations

import logging
from urllib.parse import urlencode

from aiohttp import web

from rl_cluster.config import ProxyConfig
from rl_cluster.proxy.adapters import LoadTimedOut
from rl_cluster.proxy.answers import error_response, no_active_replica, read_json
from rl_cluster.proxy.broadcast import LoadFailed
from rl_cluster.proxy.replicas import AdapterExists, NoActiveReplica, ReplicaPool
from rl_cluster.proxy.validation import check_adapter_name, check_adapter_path, check_pause_query

logger = logging.getLogger(__name__)


class ControlRoutes:
    """`adapter_root`: the bucket every `lora_path` must lie inside (None: any path)."""

    def __init__(self, config: ProxyConfig, pool: ReplicaPool, adapter_root: str | None):
        self.config, self._pool, self.adapter_root = config, pool, adapter_root

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/load_lora_adapter", self.load_adapter),
            web.post("/v1/unload_lora_adapter", self.unload_adapter),
            web.post("/pause", self.pause),
            web.post("/resume", self.resume),
        ]

    async def load_adapter(self, request: web.Request) -> web.Response:
        body = (await read_json(request, self.config.max_body_bytes))[1]
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
        if name in self._pool.base_models:
            return error_response(
                400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput"
            )
        if self._pool.book.is_routable(name) and self._pool.book.live_adapters()[name] == path:
            # Loaded already from this very path: a client's retry after an answer it never got (the
            # proxy it sent the load to died), as vLLM's names are never reused for other weights.
            return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
        try:
            await self._pool.load(name, path)
        except AdapterExists:
            return error_response(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to "
                "load the adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        except NoActiveReplica as e:
            return no_active_replica(e.waited_s, e.bound)
        except LoadTimedOut as e:
            logger.error("%s", e)
            return error_response(504, str(e), "AdapterLoadTimeout")
        except LoadFailed as e:
            logger.error("%s", e)
            replicas = {r: str(err) for r, err in e.failures.items()}
            return error_response(e.status, str(e), "AdapterLoadError", replicas=replicas)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_adapter(self, request: web.Request) -> web.Response:
        body = (await read_json(request, self.config.max_body_bytes))[1]
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return error_response(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
            )
        if not await self._pool.close(name):
            return error_response(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        # The name is closed to new requests now; replicas unload it as their in-flight requests finish.
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def pause(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        check_pause_query(query)
        failures = await self._pool.pause(urlencode(query))
        if failures:
            return error_response(
                502, f"pause failed on {sorted(failures)}; resumed all", "PauseError", replicas=failures
            )
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        failures = await self._pool.resume()
        if failures:
            return error_response(
                502, f"resume failed on {sorted(failures)}", "ResumeError", replicas=failures
            )
        return web.json_response({"status": "resumed"})
