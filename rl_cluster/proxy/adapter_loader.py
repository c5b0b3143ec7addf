"""How the proxy loads and unloads adapters on one replica: the AdapterLoader protocol and its HTTP form.

The proxy never needs more from a replica's adapter side than these two calls, so a replica may be a
bare vLLM server (HttpAdapterLoader) or a GeneratorActor that verifies the bucket's manifest first.
"""

from __future__ import annotations

import json
from typing import Protocol, runtime_checkable

import aiohttp

from rl_cluster.errors import (
    AdapterError,
    AdapterNotFound,
    AdapterRejected,
    ReplicaMisbehaved,
    ReplicaServerError,
)
from rl_cluster.generator.vllm_compat import ALREADY_LOADED

# Admin calls to a replica (adapter loads, pause, resume, /v1/models) are bounded so that a hung replica
# turns into an error instead of a hung trainer.
ADMIN_TIMEOUT = aiohttp.ClientTimeout(total=600, sock_connect=10)
INFO_TIMEOUT = aiohttp.ClientTimeout(total=30)


@runtime_checkable
class AdapterLoader(Protocol):
    """How the proxy loads and unloads adapters on one replica. Raises rl_cluster.errors:
    AdapterNotFound (retryable: not visible yet), AdapterRejected or AdapterError (a real failure)."""

    async def load_adapter(self, name: str, path: str) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...


def error_message(text: str) -> str:
    """The human part of a vLLM error body ({"error": {"message": ...}} or {"error": "..."}), else the text."""
    try:
        payload = json.loads(text)
    except ValueError:
        return text.strip()
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    if isinstance(payload, dict) and ("error" in payload or "detail" in payload):
        return str(payload.get("error") or payload.get("detail"))
    return text.strip()


async def served_models(session: aiohttp.ClientSession, url: str) -> tuple[list[str], set[str]]:
    """The base model ids and the adapter names a replica serves right now (its /v1/models)."""
    async with session.get(f"{url}/v1/models", timeout=INFO_TIMEOUT) as response:
        response.raise_for_status()
        models = (await response.json())["data"]
    base = [m["id"] for m in models if not m.get("parent")]
    return base, {m["id"] for m in models if m.get("parent")}


class HttpAdapterLoader:
    """Loads and unloads adapters through a vLLM server's runtime LoRA endpoints."""

    def __init__(self, url: str, session: aiohttp.ClientSession | None = None):
        self.url = url.rstrip("/")
        self._session = session  # None: a short-lived session per call

    async def _post(self, path: str, payload: dict) -> tuple[int, str]:
        session = self._session or aiohttp.ClientSession()
        try:
            async with session.post(self.url + path, json=payload, timeout=ADMIN_TIMEOUT) as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise AdapterError(f"replica {self.url} unreachable for {path}: {type(e).__name__}: {e}") from e
        finally:
            if session is not self._session:
                await session.close()

    async def load_adapter(self, name: str, path: str) -> None:
        # load_inplace stays False: names are never reused for different weights (vLLM keys its prefix
        # cache by adapter name), and in-place loading re-reads the adapter from disk on every request.
        status, text = await self._post(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": False}
        )
        message = error_message(text)
        # 400 "already loaded": it holds that name, and a name is never reused for other weights
        # (vllm_compat item 5).
        if status == 200 or (status == 400 and ALREADY_LOADED in message):
            await self._check_serves(name, status)
            return
        # vLLM answers a path it cannot find with 404 "... No adapter found for <path>"; a 404 without that
        # phrase means the route itself is missing (VLLM_ALLOW_RUNTIME_LORA_UPDATING unset): not retryable.
        if status == 404 and "No adapter found" in message:
            raise AdapterNotFound(f"{self.url}: {message}")
        raise self._failure(status, message)

    async def unload_adapter(self, name: str) -> None:
        status, text = await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        if status == 200:
            return
        message = error_message(text)
        if status == 404:
            raise AdapterNotFound(f"{self.url}: {message}")
        raise self._failure(status, message)

    async def _check_serves(self, name: str, status: int) -> None:
        """A load is believed only when /v1/models then lists it: a replica that answers 200 to a load it
        did not do would fail every request routed to it for that version."""
        session = self._session or aiohttp.ClientSession()
        try:
            _, served = await served_models(session, self.url)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as e:
            raise ReplicaMisbehaved(
                f"{self.url} answered HTTP {status} to loading {name!r}, then no readable /v1/models "
                f"({type(e).__name__}: {e})"
            ) from None
        finally:
            if session is not self._session:
                await session.close()
        if name not in served:
            raise ReplicaMisbehaved(
                f"{self.url} answered HTTP {status} to loading {name!r} but its /v1/models does not list it"
            )

    def _failure(self, status: int, message: str) -> AdapterError:
        # A 5xx may be the server's own trouble (a dead engine core answers "EngineCore encountered an
        # issue") or a refusal (vLLM answers some, such as a rank above --max-lora-rank, with a 500): the
        # broadcast asks the replica's health which (rl_cluster.proxy.broadcast).
        kind = ReplicaServerError if status >= 500 else AdapterRejected
        return kind(f"{self.url}: HTTP {status}: {message}")
