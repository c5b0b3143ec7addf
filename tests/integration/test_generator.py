"""GeneratorActor on a real local Ray and a real vLLM CPU server: it refuses adapters that are not what
was published, keeps serving the previous version, and its vLLM process tree dies with it."""

from __future__ import annotations

import pytest
import ray
import requests
from conftest import publish_lora, tiny_run_config, vllm_pids_with, wait_until_no_vllm_with

from rl_cluster.bucket import Bucket
from rl_cluster.errors import AdapterRejected
from rl_cluster.generator.actor import GeneratorActor

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
