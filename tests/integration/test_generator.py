"""GeneratorActor on a real local Ray and a real vLLM CPU server: it refuses adapters that are not what
was published, keeps serving the previous version, and its vLLM process tree dies with it; a pool
controller Ray restarted takes the run's generators over, and they end with their run."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

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
    """On one replica over both cores (generator.tensor_parallel_size=2: two vLLM workers, one per core),
    which the gate, loads and the process tree treat as any replica. A killed TP worker takes its server
    down, and the actor restarts the whole server."""
    run = "gen-test"
    config = tiny_run_config(
        run, tiny_model_dir, tmp_path, "generator.tensor_parallel_size=2", "generator.restart_backoff_s=0.1"
    )
    bucket = Bucket(config.bucket.uri)
    uris = {version: publish_lora(bucket, run, version, tiny_model_dir, tmp_path) for version in (1, 2)}
    actor = GeneratorActor.options(num_cpus=0, resources={"generator": 2}).remote("g0", config, str(tmp_path))
    try:
        url = await actor.start.remote(0)
        assert vllm_pids_with(marked_ray), "the actor's vLLM server should be running"
        # vLLM's own lines, its TP workers' too, are in the replica's log while it runs.
        log = (tmp_path / "vllm-g0.log").read_text(errors="replace")
        assert "non-default args" in log and "(Worker_TP1 pid=" in log, log[-2000:]
        workers = tp_workers(marked_ray)
        assert len(workers) == 2, workers  # one per rank, bound to cores 0 and 1
        assert sorted(sorted(os.sched_getaffinity(pid)) for pid in workers.values()) == [[0], [1]], workers
        assert (await actor.placement.remote())["cores"] == [0, 1]  # claimed on this node for its life

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

        # One TP worker SIGKILLed: the server cannot serve on half a model; the actor restarts all of it.
        os.kill(workers["TP1"], signal.SIGKILL)
        deadline = time.monotonic() + 240
        while (await actor.condition.remote()).restarts < 1 and time.monotonic() < deadline:
            await asyncio.sleep(1)
        assert (await actor.condition.remote()).restarts == 1
        while time.monotonic() < deadline:  # serving again, on two new workers
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            await asyncio.sleep(1)
        base = {**prompt, "model": config.model.path}  # its adapters come back with the proxy's catch-up
        assert requests.post(f"{url}/v1/completions", json=base, timeout=60).status_code == 200
        assert len(again := tp_workers(marked_ray)) == 2 and not set(again.values()) & set(workers.values())
    finally:  # also when it failed: a server left running held both cores and failed the next test
        # Killed without a shutdown call (as `ray.kill` or a dead node would): the watchdog ends vLLM.
        ray.kill(actor)
    assert not wait_until_no_vllm_with(marked_ray), "vLLM outlived its actor"


def tp_workers(marker: str) -> dict[str, int]:
    """{"TP0": pid, ...}: the vLLM workers of the test's servers, titled VLLM::Worker_TP<rank> (in full on
    their command line; `comm` keeps 15 characters)."""
    found = {}
    for pid in vllm_pids_with(marker):
        with contextlib.suppress(OSError):
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            if title.startswith("VLLM::Worker"):
                found[title.rsplit("_", 1)[-1]] = pid
    return found


async def wait_serving(pool, replicas: list[str], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while sorted((await pool.status.remote())["serving"]) != replicas and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert sorted((await pool.status.remote())["serving"]) == replicas


class HeldRequests:
    """Four completions through the proxy, each a new prompt (each goes to the least loaded replica), held
    in flight: every vLLM server of the test is SIGSTOPped until `release()`."""

    def __init__(self, marker: str, proxy_url: str, model: str):
        self.servers = sorted(vllm_pids_with(marker))
        for pid in self.servers:
            os.kill(pid, signal.SIGSTOP)
        self.posts = [
            asyncio.create_task(asyncio.to_thread(self._post, proxy_url, model, n)) for n in range(4)
        ]

    @staticmethod
    def _post(proxy_url: str, model: str, n: int) -> int:
        body = {"model": model, "prompt": f"held #{n}: {n}+1=", "max_tokens": 4}
        return requests.post(f"{proxy_url}/v1/completions", json=body, timeout=300).status_code

    async def in_flight(self, proxy, expected: dict[str, int], timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            replicas = (await proxy.stats.remote())["replicas"]
            if (seen := {rid: replicas[rid]["in_flight"] for rid in expected}) == expected:
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"in flight: {seen}, not {expected}")

    def release(self) -> None:
        for pid in self.servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    async def answers(self) -> list[int]:
        self.release()
        return list(await asyncio.gather(*self.posts))


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
    # No health checks: the servers are SIGSTOPped below to hold requests in flight, not to fail them.
    config = config.model_copy(update={"proxy": config.proxy.model_copy(update={"health_interval_s": 600.0})})
    cluster, held = await start_proxy(config, str(tmp_path)), None
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
        # starter, started all the same; once it serves, one of the two is drained and stopped. Its drain
        # waits for requests held in flight (both vLLM servers SIGSTOPped), and the controller is killed
        # again meanwhile: its successor finishes taking the replica out, and every request is answered.
        await wait_serving(pool, ["g0", "g1"])
        held = HeldRequests(marked_ray, cluster.proxy_url, str(tiny_model_dir))
        await held.in_flight(cluster.proxy, {"g0": 2, "g1": 2})
        await pool.set_target.remote(1)
        status = await pool.status.remote()
        (leaving,) = status["leaving"]
        assert (await cluster.proxy.stats.remote())["replicas"][leaving]["state"] == "draining"
        killed = the_runs_process(marked_ray, b"ray::PoolController", 30)
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 60  # the successor takes it out again: it is leaving there too
        while leaving not in (await pool.status.remote())["leaving"] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert leaving in (await pool.status.remote())["leaving"], "the successor forgot the drain under way"
        assert await held.answers() == [200] * 4  # the servers go on (SIGCONT): nothing in flight was lost
        deadline = time.monotonic() + 180
        while len(running_generators(run)) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert sorted(running_generators(run)) == sorted({"g0", "g1"} - {leaving})
        status = await pool.status.remote()
        shrink = status["events"][-1]
        assert (shrink["from"], shrink["to"], shrink["reason"]) == (2, 1, "manual: target 1"), shrink
        assert shrink["replicas"] == [leaving] and leaving in shrink["drain"], shrink
        assert status["restarts"]["pool"] == 2 and not status["leaving"], status
        # The driver is gone (its proxy dead for good): each generator ends itself and its server.
        ray.kill(pool, no_restart=True)
        ray.kill(cluster.proxy, no_restart=True)
        deadline = time.monotonic() + 60
        while running_generators(run) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert not running_generators(run), "a generator outlived its run's proxy"
        assert not wait_until_no_vllm_with(marked_ray), "vLLM outlived its generator"
    finally:
        if held is not None:
            held.release()  # never leave a stopped process of ours behind
        await cluster.shutdown()
        await stop_generators(run)
