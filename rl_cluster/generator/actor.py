"""GeneratorActor: one supervised vLLM server, and the gate adapters pass before it loads them.

The proxy never asks vLLM to load a path directly: it asks this actor, which first fetches the version
from the bucket (a copy into a local cache for s3://) and verifies its manifest against the model this
replica serves. Only then does vLLM see the path.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from pathlib import Path

import aiohttp
import ray
from prometheus_client.parser import text_string_to_metric_families

from rl_cluster.bucket import Bucket, apply_cache_retention
from rl_cluster.config import RunConfig
from rl_cluster.core.auth import bearer_headers
from rl_cluster.core.manifest import split_adapter_dir_name
from rl_cluster.core.restarts import GeneratorCondition, RestartBudget
from rl_cluster.core.telemetry import GENERATOR_METRICS, PrefixCacheCounts, vllm_gauges
from rl_cluster.errors import ReplicaDown, ReplicaUnreachable
from rl_cluster.generator.cores import CoreClaim, replica_cores
from rl_cluster.generator.run_watch import end_with_the_run
from rl_cluster.generator.server import VLLMServer, server_spec
from rl_cluster.models import model_fingerprint, resolve_model
from rl_cluster.nodes import node_placement
from rl_cluster.proxy.adapter_loader import HttpAdapterLoader
from rl_cluster.telemetry import RayMetricSet


def max_num_seqs(extra_args: list[str]) -> int | None:
    """The replica's capacity when its flags set it (`--max-num-seqs N`); None leaves it to the proxy,
    which asks the server (vLLM's default depends on the hardware)."""
    for i, arg in enumerate(extra_args):
        if arg.startswith("--max-num-seqs="):
            return int(arg.split("=", 1)[1])
        if arg == "--max-num-seqs" and i + 1 < len(extra_args):
            return int(extra_args[i + 1])
    return None


SUPERVISE_INTERVAL_S = 2.0
METRICS_EVERY = 3  # supervision rounds between two exports of the replica's metrics
UNHEALTHY_CHECKS = 3  # a server busy with long prefills may miss one /health; three in a row is dead
HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=10)


async def tell_proxy(proxy, replica_id: str, method: str, *args) -> bool:
    """report_down / report_back; False when the proxy could not be told (it is restarting): it learns the
    replica's state from its membership when it is restored (rl_cluster.proxy.rejoin), and the restart
    goes on. True when there is no proxy to tell."""
    if proxy is None:
        return True
    try:
        await getattr(proxy, method).remote(replica_id, *args)
        return True
    except ray.exceptions.RayActorError as e:
        print(f"replica {replica_id}: the proxy was not told ({method}): {type(e).__name__}", flush=True)
        return False


async def vllm_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """vLLM's /metrics at `url`, each sample summed over its labels; None when the server does not answer."""
    try:
        async with session.get(f"{url}/metrics", timeout=HEALTH_TIMEOUT) as response:
            response.raise_for_status()
            page = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def trim_cache(config: RunConfig, cache: Path, newest: str, held: list[str | None]) -> None:
    """Drop a replica's cached copies outside the live window, except versions vLLM holds or dropped one
    sync ago (`held`: vLLM re-reads an evicted adapter from its path)."""
    prefix, _ = split_adapter_dir_name(newest)
    versions = [split_adapter_dir_name(n) for n in held if n]
    keep = {version for name, version in filter(None, versions) if name == prefix}
    apply_cache_retention(cache, config.run_name, prefix, live_window=config.trainer.max_staleness + 2,
                          keep_every=0, protected=keep)  # fmt: skip


class Generator:
    def __init__(
        self,
        replica_id: str,
        config: RunConfig,
        log_dir: str,
        api_key: str | None = None,
        loopback: bool = True,
        environment: dict[str, str] | None = None,
    ):
        """`api_key`: the run's replica key, demanded by the server on every route but /health.
        `loopback`: bind 127.0.0.1 (a private local Ray), else this node's address, where the proxy on
        another node reaches it. `environment`: the driver's secrets (HF_TOKEN), for this process and
        the vLLM server it starts."""
        os.environ.update(environment or {})
        self.replica_id = replica_id
        self.config = config
        self.api_key = api_key
        self.host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        self.log_dir = Path(log_dir)
        self.bucket = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url)
        self.server: VLLMServer | None = None
        self.vllm: HttpAdapterLoader | None = None
        self._session: aiohttp.ClientSession | None = None
        self.base_fingerprint = ""
        self.proxy = None
        self.loaded: dict[str, str] = {}  # adapter name -> the bucket path it was loaded from
        self.held_before_restart: dict[str, str] = {}  # a crashed server's, until the new one caught up
        self.ever_loaded: set[str] = set()  # over the run, across restarts of its server and of the proxy
        self.last_unloaded: str | None = None
        self.restarts = RestartBudget(config.generator.max_restarts, config.generator.restart_backoff_s)
        self._supervisor: asyncio.Task | None = None
        self._run_watch: asyncio.Task | None = None
        self._stopping = False
        self.slot: int | None = None  # the replica_index its server was started with
        self.cores = CoreClaim(())  # on a CPU: its workers' cores on this node, held for its life
        # A fresh actor has not begun start(): after Ray restarted a dead one, the run's pool controller
        # sees that (condition()) and starts it again, passing on the restarts of its earlier lives.
        self._began = False
        self.earlier_restarts = 0
        self.spent = False  # its restart budget ran out: the pool replaces it
        self.metrics = RayMetricSet(GENERATOR_METRICS, config.run_name)
        self.prefix_cache = PrefixCacheCounts()  # vLLM's own counters over the run, across its restarts

    async def start(self, replica_index: int, proxy=None, earlier_restarts: int = 0) -> str:
        """Start vLLM, wait until healthy, register with `proxy` (which loads every live adapter version
        on it before routing to it), return the server's URL. `earlier_restarts`: the replica's restarts
        before this actor (a revived one) existed."""
        self._began, self.earlier_restarts, self.slot = True, earlier_restarts, replica_index
        try:
            return await self._start(replica_index, proxy)
        except BaseException:
            self._began = False
            await self._discard_server()  # a start asked again would start a second one beside it
            raise

    async def _discard_server(self) -> None:
        """The server a failed start made, stopped: a start asked again must not leave it holding its port."""
        server, session, self.server, self._session, self.vllm = self.server, self._session, None, None, None
        if session is not None:
            await session.close()
        if server is not None:
            await asyncio.to_thread(server.stop)

    def membership(self) -> tuple[str, ActorAdapterLoader, int | None, dict[str, str]] | None:
        """What a proxy needs to route here: (url, control, capacity, held: its adapter versions and their
        bucket paths, a crashed server's too until the new one caught up). None without a server."""
        if self.server is None or self.vllm is None:
            return None
        me, g = ray.get_runtime_context().current_actor, self.config.generator
        held = {**self.held_before_restart, **self.loaded}
        return self.server.url, ActorAdapterLoader(me), max_num_seqs(g.extra_args), held

    def condition(self) -> GeneratorCondition:
        """What the run's pool controller polls each round."""
        reasons = self.restarts.reasons
        return GeneratorCondition(self._began, self.spent, self.restart_count(), reasons[-1] if reasons else None,
                                  self.slot)  # fmt: skip

    async def _start(self, replica_index: int, proxy) -> str:
        model = self.config.model
        model_dir = await asyncio.to_thread(resolve_model, model.path, model.revision)
        self.base_fingerprint = model_fingerprint(model_dir)
        if not self.cores.cores:  # claimed once: a restarted server keeps its cores
            self.cores = replica_cores(self.config.generator, replica_index, self.replica_id)
        spec = server_spec(self.config, str(model_dir), self.cores.cores, self.host, self.api_key)
        self.server = VLLMServer(spec, self.log_dir / f"vllm-{self.replica_id}.log")
        self.server.start()
        await self.server.wait_healthy(self.config.generator.startup_timeout_s)
        # The replica demands the run's key on every route; this actor's calls carry it.
        self._session = aiohttp.ClientSession(headers=bearer_headers(self.api_key))
        self.vllm = HttpAdapterLoader(self.server.url, self._session)
        if proxy is not None:
            url, control, capacity, _ = self.membership()
            await proxy.add_replica.remote(self.replica_id, url, control, capacity)
            self.proxy = proxy
            ends = end_with_the_run(proxy, self.replica_id, functools.partial(self.shutdown, leave=False))
            self._run_watch = asyncio.get_running_loop().create_task(ends)
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        return self.server.url

    # -- supervision: a dead server is restarted in place, bounded ---------------------------------------

    async def _supervise(self) -> None:
        """Watch the server; when it died (or failed /health UNHEALTHY_CHECKS times in a row), tell the
        proxy at once (no traffic), restart it on the same port, and hand it back to the proxy, which
        reloads every live adapter version on it before routing to it again."""
        failed_checks = 0
        rounds = 0
        while not self._stopping:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            rounds += 1
            if rounds % METRICS_EVERY == 1:
                try:
                    await self._export_metrics()
                except Exception as e:  # a malformed /metrics page: the gauges wait, supervision goes on
                    print(
                        f"replica {self.replica_id}: metrics not exported: {type(e).__name__}: {e}",
                        flush=True,
                    )
            code = self.server.process.poll() if self.server and self.server.process else None
            if code is not None:
                reason = f"vLLM server exited with code {code}"
            else:
                failed_checks = 0 if await self._healthy() else failed_checks + 1
                if failed_checks < UNHEALTHY_CHECKS:
                    continue
                reason = f"vLLM server failed /health {failed_checks} times in a row"
            failed_checks = 0
            try:
                if self._stopping or not await self._restart(reason):
                    return
            except Exception as e:  # noqa: BLE001  died again while starting, or the proxy could not be told
                # (a RayActorError while it restarts): the next round sees the server's state again, and the
                # restarts' budget bounds how often. Ending here would leave the replica unsupervised for good.
                print(f"replica {self.replica_id}: restart failed: {type(e).__name__}: {e}", flush=True)

    async def _export_metrics(self) -> None:
        """The replica's own gauges, and vLLM's KV cache usage and queue lengths from its /metrics."""
        tags = {"replica": self.replica_id}
        self.metrics.set("rl_generator_adapters_loaded", len(self.loaded), **tags)
        self.metrics.set("rl_generator_restarts", self.restarts.used, **tags)
        samples = await vllm_metrics(self._session, self.server.url)
        self.metrics.set("rl_generator_up", int(samples is not None), **tags)
        if samples is None:
            return
        for name, value in vllm_gauges(samples).items():
            self.metrics.set(name, value, **tags)
        self.prefix_cache.observe(samples)
        if (rate := self.prefix_cache.hit_rate) is not None:
            self.metrics.set("rl_generator_prefix_cache_hit_rate", rate, **tags)

    async def _healthy(self) -> bool:
        try:
            async with self._session.get(f"{self.server.url}/health", timeout=HEALTH_TIMEOUT) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _restart(self, reason: str) -> bool:
        delay = self.restarts.next_delay(reason)
        limit, what = self.config.generator.max_restarts, f"replica {self.replica_id}: {reason}"
        await tell_proxy(self.proxy, self.replica_id, "report_down", reason)
        if delay is None:
            self.spent = True
            print(f"{what}; restart budget ({limit}) spent: it stays out", flush=True)
            return False
        print(f"{what}; restart {self.restarts.used}/{limit} in {delay:.0f}s", flush=True)
        start = time.monotonic()
        await asyncio.to_thread(self.server.stop)  # whatever is left of its process group
        await asyncio.sleep(delay)
        self.held_before_restart = {**self.held_before_restart, **self.loaded}
        self.loaded.clear()  # a new server holds no adapter
        self.prefix_cache.restarted()  # and counts its cache from zero
        self.server.start()
        await self.server.wait_healthy(self.config.generator.startup_timeout_s)
        if await tell_proxy(self.proxy, self.replica_id, "report_back"):  # answers once it caught up
            self.held_before_restart = {}  # else the restored proxy catches it up from these
        print(
            f"replica {self.replica_id}: serving again {time.monotonic() - start:.0f}s after the crash",
            flush=True,
        )
        return True

    async def report(self, fresh: bool = True) -> dict:
        """For the summary: `prefix_cache`, vLLM's counters (queries, hits in prompt tokens, hit_rate; read
        now when `fresh`, else as last exported) and `versions_loaded`, every adapter it loaded."""
        if fresh and self.server is not None and not self._stopping:
            await self._export_metrics()
        return {"prefix_cache": self.prefix_cache.as_dict(), "versions_loaded": sorted(self.ever_loaded)}

    def restart_count(self) -> int:
        """Restarts of this replica: its vLLM server's, and its actor's own (each counts once)."""
        return self.earlier_restarts + self.restarts.used

    def server_pgid(self) -> int | None:
        """The vLLM server's process group (tests kill its members to play a crash)."""
        return self.server.process.pid if self.server and self.server.process else None

    def placement(self) -> dict:
        return {**node_placement(), "cores": list(self.cores.cores)}  # []: unbound

    async def load_adapter(self, name: str, path: str) -> None:
        """Fetch and verify `path` (raises AdapterNotFound / AdapterRejected), then load it into vLLM."""
        if self.vllm is None:
            raise ReplicaDown(f"replica {self.replica_id} has no server yet (its actor was restarted)")
        local = await asyncio.to_thread(
            self.bucket.fetch_verified,
            path,
            # One cache per replica: replicas on one machine must not share half-downloaded copies.
            cache_dir=Path(self.config.bucket.cache_dir) / self.replica_id,
            base_fingerprint=self.base_fingerprint,
            max_lora_rank=self.config.generator.max_lora_rank,
        )
        await self.vllm.load_adapter(name, str(local))
        self.loaded[name] = path
        self.ever_loaded.add(name)
        await asyncio.to_thread(self._trim_cache, name)

    async def unload_adapter(self, name: str) -> None:
        await self.vllm.unload_adapter(name)
        self.loaded.pop(name, None)
        self.last_unloaded = name

    def _trim_cache(self, newest: str) -> None:
        trim_cache(self.config, Path(self.config.bucket.cache_dir) / self.replica_id, newest,
                   held=[*self.loaded, self.last_unloaded])  # fmt: skip

    async def shutdown(self, drain_timeout_s: float = 30.0, leave: bool = True) -> None:
        """Leave the proxy (it stops routing here and waits, bounded, for in-flight requests), then stop
        vLLM. Leaving first keeps the proxy from seeing a replica fail its health check. `leave` False: the
        proxy is gone for good (rl_cluster.generator.run_watch)."""
        self._stopping = True
        for task in (self._supervisor, self._run_watch):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        if self.proxy is not None and leave:
            try:
                await self.proxy.remove_replica.remote(self.replica_id, drain_timeout_s)
            except Exception as e:  # a proxy that is gone already has nothing to drain
                print(f"replica {self.replica_id}: could not leave the proxy: {e}", flush=True)
            self.proxy = None
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
            self.server = None
        self.cores.release()  # its server is gone: the cores are free for another replica of the node
        if self._session is not None:
            await self._session.close()
            self._session = None


GeneratorActor = ray.remote(Generator)


class ActorAdapterLoader:
    """The proxy's handle on a replica whose loads go through its GeneratorActor (verify, then load)."""

    def __init__(self, actor):
        self.actor = actor

    def placement(self) -> dict:
        return node_placement()

    async def load_adapter(self, name: str, path: str) -> None:
        try:
            await self.actor.load_adapter.remote(name, path)
        except ray.exceptions.RayTaskError as e:
            # The proxy reports the replica's reason to its client: the cause, not Ray's traceback.
            raise e.cause from None
        except ray.exceptions.ActorUnavailableError:
            raise ReplicaUnreachable("Ray cannot reach its generator actor (ActorUnavailableError)") from None
        except ray.exceptions.RayActorError as e:
            raise ReplicaDown(f"its generator actor died: {type(e).__name__}") from None

    async def unload_adapter(self, name: str) -> None:
        try:
            await self.actor.unload_adapter.remote(name)
        except ray.exceptions.RayTaskError as e:
            raise e.cause from None
