"""A replica whose vLLM server dies is restarted in place and caught up, and a sync meanwhile goes on
without it; then, on the same cluster, generation capacity shrinks and grows under the live proxy: a
generator that leaves drains first, and one that joins is caught up (every live adapter version loaded)
before it takes traffic. Real Ray actors, real vLLM CPU servers, the run's keys, a directory bucket (one
cluster for both: each start of a pair of vLLM CPU servers costs about a minute here)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import ray
from conftest import publish_lora, tiny_run_config, vllm_pids_with, wait_until_no_vllm_with

from rl_cluster.bucket import Bucket
from rl_cluster.cluster import RunSecrets, launch

pytestmark = pytest.mark.vllm


def api_servers(marker: str, settle_s: float = 45) -> set[int]:
    """This module's vLLM API server processes, once no more than one per generator is left (a server
    whose actor died is ended by its watchdog within seconds)."""

    def servers() -> set[int]:
        found = set()
        for pid in vllm_pids_with(marker):
            try:
                if b"--served-model-name" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.add(pid)
            except OSError:
                continue
        return found

    deadline = time.monotonic() + settle_s
    while len(found := servers()) > 2 and time.monotonic() < deadline:
        time.sleep(1)
    return found


async def wait_for(what, predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (value := await predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(1)
    return value


async def test_a_killed_server_comes_back_caught_up_and_the_pool_shrinks_and_grows(
    marked_ray, tiny_model_dir, tmp_path
):
    run = "restart-test"
    config = tiny_run_config(run, tiny_model_dir, tmp_path)
    config.generator.replicas = 2
    config.generator.restart_backoff_s = 1.0
    bucket = Bucket(config.bucket.uri)
    v1, v2, v3 = (publish_lora(bucket, run, v, tiny_model_dir, tmp_path) for v in (1, 2, 3))
    secrets = RunSecrets.for_run(config)
    control = {"Authorization": f"Bearer {secrets.proxy_token}"}  # every route but /health, /metrics
    cluster = await launch(config, str(tmp_path / "logs"), secrets)
    try:
        async with aiohttp.ClientSession() as http:

            async def load(name, uri):
                body = {"lora_name": name, "lora_path": uri}
                async with http.post(
                    f"{cluster.proxy_url}/v1/load_lora_adapter", json=body, headers=control
                ) as r:
                    return r.status, await r.text()

            async def replicas():
                return (await cluster.proxy.stats.remote())["replicas"]

            assert (await load(f"{run}-v1", v1))[0] == 200

            # A crash: the whole vLLM process tree of g0 is SIGKILLed.
            crashed = time.monotonic()
            os.killpg(await cluster.generators["g0"].server_pgid.remote(), signal.SIGKILL)

            # A sync while g0 is down goes on without it (it may not have noticed the crash yet).
            status, text = await load(f"{run}-v2", v2)
            assert status == 200, text
            assert (await replicas())["g0"]["state"] != "active"

            # g0 comes back, loads every live version before it is active again, and serves.
            async def g0_back():
                g0 = (await replicas())["g0"]
                return g0["state"] == "active" and {f"{run}-v1", f"{run}-v2"} <= set(g0["adapters_loaded"])

            await wait_for("g0 to be active with v1 and v2", g0_back, 240)
            back_after = time.monotonic() - crashed
            assert await cluster.generators["g0"].restart_count.remote() == 1

            async def served_by(model: str, prompt: str) -> set[str]:
                """The replicas that answered 12 requests with new prompts (every one must succeed)."""
                replicas_seen = set()
                for i in range(12):
                    request = {"model": model, "prompt": prompt.format(i), "max_tokens": 2}
                    async with http.post(
                        f"{cluster.proxy_url}/v1/completions", json=request, headers=control
                    ) as r:
                        assert r.status == 200, await r.text()
                        replicas_seen.add(r.headers["X-Proxy-Replica"])
                return replicas_seen

            assert (served := await served_by(f"{run}-v2", "{}+1=")) == {"g0", "g1"}, served
            print(f"\ncrash -> serving again: {back_after:.0f} s")

            # The generator actor itself dies. Ray restarts it (a fresh actor, no server), the old server
            # is ended by its watchdog, and the pool's look for restarted actors finds it and starts it
            # again: it registers anew, replacing the dead entry, and loads every live version first.
            assert await cluster.generators_to_mend() == {}  # both up: nothing to do
            g0 = cluster.generators["g0"]
            died = time.monotonic()
            ray.kill(g0, no_restart=False)
            needs = await wait_for("Ray to restart g0's actor", cluster.generators_to_mend, 120)
            assert needs == {"g0": "restarted"}
            status, text = await load(f"{run}-v3", v3)  # a sync meanwhile goes on without it
            assert status == 200, text
            await cluster.revive("g0")
            print(f"actor death -> serving again: {time.monotonic() - died:.0f} s")
            g0_state = (await replicas())["g0"]
            assert g0_state["state"] == "active", g0_state
            assert {f"{run}-v1", f"{run}-v2", f"{run}-v3"} <= set(g0_state["adapters_loaded"]), g0_state
            assert await g0.restart_count.remote() == 2  # its server's restart, then its actor's
            assert len(api_servers(marked_ray)) == 2  # the dead actor's server did not outlive it
            assert (served := await served_by(f"{run}-v3", "{}+2=")) == {"g0", "g1"}, served

            # Shrink: g1 leaves, drained; v2 keeps being served, by g0.
            await cluster.remove_generator("g1")
            assert set(await replicas()) == {"g0"}
            # Grow: the newcomer holds every live version before it is active.
            assert await cluster.add_generators(1) == ["g2"]
            g2 = (await replicas())["g2"]
            assert g2["state"] == "active" and {f"{run}-v1", f"{run}-v3"} <= set(g2["adapters_loaded"]), g2
            await cluster.remove_generator("g0")
            request = {"model": f"{run}-v2", "prompt": "1+2=", "max_tokens": 4}
            async with http.post(f"{cluster.proxy_url}/v1/completions", json=request, headers=control) as r:
                assert r.status == 200, await r.text()
                assert r.headers["X-Proxy-Replica"] == "g2"
    finally:
        await cluster.shutdown()
    assert not wait_until_no_vllm_with(marked_ray)
