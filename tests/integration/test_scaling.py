"""Generation capacity grows and shrinks under a live proxy: a generator that joins is caught up (every
live adapter version loaded) before it takes traffic, and one that leaves drains first. Real Ray actors
and real vLLM CPU servers."""

from __future__ import annotations

import aiohttp
import pytest
from conftest import publish_lora, tiny_run_config, wait_until_no_vllm_with

from rl_cluster.bucket import Bucket
from rl_cluster.cluster import launch

pytestmark = pytest.mark.vllm


async def test_a_generator_joins_caught_up_and_one_leaves_drained(marked_ray, tiny_model_dir, tmp_path):
    run = "scale-test"
    config = tiny_run_config(run, tiny_model_dir, tmp_path)
    uri = publish_lora(Bucket(config.bucket.uri), run, 1, tiny_model_dir, tmp_path)
    cluster = await launch(config, str(tmp_path / "logs"))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{cluster.proxy_url}/v1/load_lora_adapter", json={"lora_name": f"{run}-v1", "lora_path": uri}
            ) as r:
                assert r.status == 200, await r.text()

            # Grow: the new replica holds v1 before it is active.
            assert await cluster.add_generators(1) == ["g1"]
            replicas = (await cluster.proxy.stats.remote())["replicas"]
            assert replicas["g1"]["state"] == "active"
            assert f"{run}-v1" in replicas["g1"]["adapters_loaded"]

            # Shrink: the original leaves; v1 keeps being served, by the newcomer.
            await cluster.remove_generator("g0")
            assert set((await cluster.proxy.stats.remote())["replicas"]) == {"g1"}
            request = {"model": f"{run}-v1", "prompt": "1+2=", "max_tokens": 4}
            async with http.post(f"{cluster.proxy_url}/v1/completions", json=request) as r:
                assert r.status == 200, await r.text()
                assert r.headers["X-Proxy-Replica"] == "g1"
    finally:
        await cluster.shutdown()
    assert not wait_until_no_vllm_with(marked_ray)
