"""Placement, start order and clean shutdown of a run's actors.

Start order: proxy -> generators (their vLLM servers start in parallel, ~30 s on a CPU; each registers
itself with the proxy once healthy, and the proxy loads every live adapter version on it before routing
to it) -> trainer. Shutdown runs in reverse in a `finally`: generators leave the proxy and stop vLLM,
then the proxy stops. Each vLLM server also has a watchdog that ends it if its actor dies first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from dataclasses import dataclass, field

import ray

from rl_cluster.bucket import Bucket
from rl_cluster.config import RunConfig
from rl_cluster.generator.actor import GeneratorActor
from rl_cluster.proxy.actor import ProxyActor


def connect(config: RunConfig) -> None:
    """Join the configured or running Ray cluster; else start a local one that declares the trainer and
    generator resources itself (a laptop has no node types)."""
    if ray.is_initialized():
        return
    env = {
        "env_vars": {
            # TRL 1.16 warns on every import that it was tested with vLLM <= 0.31 (we run 0.32, verified),
            # and that its async trainer is experimental: once per process, in every actor's log.
            "TRL_EXPERIMENTAL_SILENCE": "1",
            "PYTHONWARNINGS": "ignore:TRL currently supports vLLM versions",
            "TOKENIZERS_PARALLELISM": "false",
        }
    }
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, runtime_env=env)
        return
    # Join a cluster started with `ray start` on this machine, but never scan for other users' Ray
    # processes (what address="auto" does when the address file is missing).
    if address is None and os.path.exists(os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")):
        try:
            ray.init(address="auto", runtime_env=env)
            return
        except ConnectionError:
            pass
    ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        resources={"trainer": 1, "generator": config.generator.replicas},
        runtime_env=env,
    )


@dataclass
class Cluster:
    config: RunConfig
    log_dir: str
    proxy: object
    proxy_url: str
    generators: dict[str, object] = field(default_factory=dict)
    trainer: object | None = None
    _next_index: int = 0

    async def add_generators(self, count: int) -> list[str]:
        """Grow generation capacity, also during training: each new generator starts its vLLM server and
        registers with the proxy, which loads every live adapter version on it before routing to it."""
        new = []
        for index in range(self._next_index, self._next_index + count):
            replica_id = f"g{index}"
            self.generators[replica_id] = generator_actor(self.config, replica_id, self.log_dir)
            new.append((index, self.generators[replica_id]))
        self._next_index += count
        await asyncio.gather(*(actor.start.remote(index, self.proxy) for index, actor in new))
        return [f"g{index}" for index, _ in new]

    async def remove_generator(self, replica_id: str) -> None:
        """Shrink: the generator leaves the proxy (no new requests; in-flight ones finish), then stops."""
        actor = self.generators.pop(replica_id)
        try:
            await actor.shutdown.remote()
        finally:
            ray.kill(actor)

    async def shutdown(self) -> None:
        """Generators leave the proxy and stop their vLLM servers, then the proxy stops, then the actors
        are killed. Best effort at each stage: a failure must not leave the rest running."""
        stops = [g.shutdown.remote() for g in self.generators.values()]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), timeout=90)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proxy.stop.remote(), timeout=10)
        for actor in [*self.generators.values(), self.proxy, self.trainer]:
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)


def generator_actor(config: RunConfig, replica_id: str, log_dir: str):
    return GeneratorActor.options(
        name=f"{config.run_name}-generator-{replica_id}",
        num_cpus=0,
        num_gpus=config.generator.num_gpus,
        resources={"generator": 1},
    ).remote(replica_id, config, log_dir)


async def launch(config: RunConfig, log_dir: str) -> Cluster:
    """Start the proxy and the generators; return once every generator serves through the proxy."""
    # The proxy refuses adapter paths outside the bucket before any replica sees them.
    adapter_root = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url).uri
    proxy = ProxyActor.options(name=f"{config.run_name}-proxy", num_cpus=config.proxy.num_cpus).remote(
        config.proxy, adapter_root=adapter_root
    )
    cluster = Cluster(config=config, log_dir=log_dir, proxy=proxy, proxy_url=await proxy.start.remote())
    try:
        await cluster.add_generators(config.generator.replicas)
    except BaseException:
        await cluster.shutdown()
        raise
    return cluster
