"""Seeded requests with long prompts, as TRL sends them, do not crash a replica (vllm_compat item 3):
a server started without the fix dies under the load; the servers the run starts answer all of it."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from conftest import free_port

from rl_cluster.generator.server import ServerSpec, VLLMServer
from rl_cluster.generator.vllm_compat import cpu_engine_args

pytestmark = pytest.mark.vllm

REQUESTS, PROMPT_TOKENS = 32, 240  # 7,680 prompt tokens at once: several steps' budget of 2,048


async def seeded_long_prompts(url: str, model: str) -> list[int | str]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 60) for _ in range(PROMPT_TOKENS)] for _ in range(REQUESTS)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:

        async def one(seed: int, prompt: list[int]) -> int | str:
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": seed}
            try:
                async with http.post(f"{url}/v1/completions", json=body) as r:
                    return r.status
            except aiohttp.ClientError as e:
                return type(e).__name__

        return await asyncio.gather(*(one(seed, p) for seed, p in enumerate(prompts)))


async def healthy(url: str) -> bool:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.get(f"{url}/health") as r,
        ):
            return r.status == 200
    except aiohttp.ClientError:
        return False


class ChunkedPrefillSpec(ServerSpec):
    """A server as vLLM starts it by default: chunked prefill on."""

    def command(self) -> list[str]:
        fix = cpu_engine_args(self.max_model_len)
        cmd = super().command()
        start = cmd.index(fix[0])
        return cmd[:start] + cmd[start + len(fix) :]


def test_vllm_cpu_dies_on_seeded_chunked_prefills(tiny_model_dir, tmp_path):
    spec = ChunkedPrefillSpec(model=str(tiny_model_dir), port=free_port())
    assert "--no-enable-chunked-prefill" not in spec.command()
    server = VLLMServer(spec, tmp_path / "vllm.log")
    server.start()
    try:
        asyncio.run(server.wait_healthy(300))
        statuses = asyncio.run(seeded_long_prompts(server.url, str(tiny_model_dir)))
        assert 200 not in statuses[-8:], statuses  # the engine died under the load
        assert not asyncio.run(healthy(server.url))
        assert "CPU Generator does not use offset" in server.log_path.read_text(errors="replace")
    finally:
        server.stop()


def test_the_runs_servers_answer_seeded_long_prompts(vllm_servers, tiny_model_dir):
    for server in vllm_servers:
        statuses = asyncio.run(seeded_long_prompts(server.url, str(tiny_model_dir)))
        assert statuses == [200] * REQUESTS, statuses
        assert asyncio.run(healthy(server.url))
