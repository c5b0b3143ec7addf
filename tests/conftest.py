"""Shared fixtures: the locally made tiny model and a pair of real vLLM CPU servers.

The servers are session-scoped because each takes ~30 s to start on 2 cores; tests that change a
server's state (load adapters, pause) must undo it or use names of their own.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from rl_cluster.generator.server import ServerSpec, VLLMServer

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from rl_cluster.tiny import ensure_tiny_model

    return ensure_tiny_model(os.environ.get("RL_CLUSTER_CACHE", REPO / ".cache"))


@pytest.fixture(scope="session")
def vllm_servers(tiny_model_dir, tmp_path_factory) -> list[VLLMServer]:
    """Two real vLLM CPU servers on the tiny model, each pinned to its own core."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    cores = os.cpu_count() or 1
    servers = [
        VLLMServer(
            ServerSpec(model=str(tiny_model_dir), port=free_port(), cpu_core=i % cores), logs / f"r{i}.log"
        )
        for i in range(2)
    ]
    try:
        for server in servers:
            server.start()

        async def wait_all():
            await asyncio.gather(*(s.wait_healthy(300) for s in servers))

        asyncio.run(wait_all())
        yield servers
    finally:
        for server in servers:
            server.stop()
