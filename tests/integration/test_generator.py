"""GeneratorActor on a real local Ray and a real vLLM CPU server: it refuses adapters that are not what
was published, keeps serving the previous version, and its vLLM process tree dies with it; a pool
controller Ray restarted takes the run's generators over, and they end with their run."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray
import requests
from conftest import publish_lora, the_runs_process, tiny_run_config, vllm_pids_with, wait_until_no_vllm_with

from rl_cluster.bucket import Bucket
from rl_cluster.cluster import start_proxy
from rl_cluster.errors import AdapterRejected
from rl_cluster.generator.actor import GeneratorActor
from rl_cluster.pool import start_pool
from rl_cluster.pool_state import running_generators, stop_generators

pytestmark = pytest.mark.vllm


async def test_generator_verifies_loads_and_dies_cleanly(marked_ray, tiny_model_dir, tmp_path):
    run = "gen-test"
    config = tiny_run_config(run, tiny_model_dir, tmp_path)
    bucket = Bucket(config.bucket.uri)
    uris = {version: publish_lora(bucket, run, version, tiny_model_dir, tmp_path) for version in (1, 2)}
    actor = GeneratorActor.options(num_cpus=0, resources={"generator": 1}).remote("g0", config, str(tmp_path))
    url = await actor.start.remote(0)
    assert vllm_pids_with(marked_ray), "the actor's vLLM server should be running"

    await actor.load_adapter.remote(f"{run}-v1", uris[1])
    prompt = {"model": f"{run}-v1", "prompt": "1+2=", "max_tokens": 4, "temperature": 0}
    assert requests.post(f"{url}/v1/completions", json=prompt, timeout=60).status_code == 200

    # A flipped byte in v2 is refused with the file named, and v1 keeps serving.
    weights = tmp_path / "bucket" / run / "adapters" / f"{run}-v2" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(AdapterRejected, match="adapter_model.safetensors"):
        await actor.load_adapter.remote(f"{run}-v2", uris[2])
    models = requests.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert {m["id"] for m in models} >= {f"{run}-v1"} and f"{run}-v2" not in {m["id"] for m in models}
    assert requests.post(f"{url}/v1/completions", json=prompt, timeout=60).status_code == 200

    # Killed without a shutdown call (as `ray.kill` or a dead node would): the watchdog ends vLLM.
    ray.kill(actor)
    assert not wait_until_no_vllm_with(marked_ray), "vLLM outlived its actor"


async def test_a_killed_pool_controller_takes_its_generators_over_and_they_end_with_the_run(
    marked_ray, tiny_model_dir, tmp_path
):
    """The generators are detached actors named in the run's namespace. SIGKILL the pool controller: Ray
    restarts it, it finds the running generator by name and its predecessor's record in the GCS, and goes
    on (it scales by hand, its events and restarts kept). Then the run's proxy is gone for good (as when
    its driver is killed): the generator stops its vLLM server and itself, leaving nothing behind."""
    run = "pool-takeover"
    config = tiny_run_config(run, tiny_model_dir, tmp_path)
    config = config.model_copy(update={"generator": config.generator.model_copy(update={"max_replicas": 2})})
    cluster = await start_proxy(config, str(tmp_path))
    try:
        await cluster.add_generators(1)
        [(rid, first)] = running_generators(run).items()
        assert rid == "g0" and first._actor_id == cluster.generators["g0"]._actor_id
        pool = await start_pool(cluster)
        grown = await pool.set_target.remote(2)  # an event, a manual target, a generator the pool started
        assert grown["size"] == 2 and sorted(running_generators(run)) == ["g0", "g1"], grown  # kept at once
        killed = the_runs_process(marked_ray, b"ray::PoolController", 30)
        os.kill(killed, signal.SIGKILL)
        status = await pool.status.remote()  # waits while Ray restarts it
        assert status["mode"] == "manual" and status["target"] == 2, status
        assert status["events"] == grown["events"] and status["restarts"] == {"proxy": 0, "pool": 1}, status
        assert the_runs_process(marked_ray, b"ray::PoolController", 30) != killed
        members = await pool.members.remote()
        assert sorted(members["generators"]) == ["g0", "g1"], members
        assert [f.what for f in members["history"].faults] == ["pool controller restarted by Ray"]
        # The successor decides and acts on the generators it took over: g1, killed mid-start with its
        # starter, started all the same; once it serves, one of the two is drained and stopped.
        await pool.set_target.remote(1)
        deadline = time.monotonic() + 180
        while len(running_generators(run)) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert len(running_generators(run)) == 1
        shrink = (await pool.status.remote())["events"][-1]
        assert (shrink["from"], shrink["to"], shrink["reason"]) == (2, 1, "manual: target 1"), shrink
        # The driver is gone (its proxy dead for good): each generator ends itself and its server.
        ray.kill(pool, no_restart=True)
        ray.kill(cluster.proxy, no_restart=True)
        deadline = time.monotonic() + 60
        while running_generators(run) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert not running_generators(run), "a generator outlived its run's proxy"
        assert not wait_until_no_vllm_with(marked_ray), "vLLM outlived its generator"
    finally:
        await cluster.shutdown()
        await stop_generators(run)
