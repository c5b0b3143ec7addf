"""Placement, addressing, start order and clean shutdown of a run's actors.

Placement: the trainer on a node with the custom resource `trainer`, one generator per `generator`
resource, and the proxy on a node with a `proxy` resource when the cluster has one, else on the driver's
node (pinned there, so its address is known and stable for the run).

Addressing: every server an actor starts binds, and advertises, its own node's address
(`ray.util.get_node_ip_address()`), because on a cluster the trainer and the generators are on other
nodes; loopback only when the driver started a private local Ray itself (nothing else can join it).
URLs travel through Ray (actor return values), never through config files.

Secrets: a run has a replica key, which every vLLM server demands on every route but /health and only
the proxy and the trainer's served-vs-trained check hold, and a proxy token for the proxy's control
routes (the configured one, else a fresh one). Neither appears in a log, a config dump or the summary.

Start order: proxy -> generators (their vLLM servers start in parallel, ~30 s on a CPU; each registers
itself with the proxy once healthy, and the proxy loads every live adapter version on it before routing
to it) -> training. The run creates the trainer's actor right after the proxy, so that its process
starts beside the vLLM servers; it trains once they serve. Shutdown runs in reverse in a `finally`:
generators leave the proxy and stop vLLM, then the proxy stops. Each vLLM server also has a watchdog
that ends it if its actor dies first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import secrets
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import NamedTuple

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rl_cluster.bucket import Bucket
from rl_cluster.config import RunConfig
from rl_cluster.core.placement import Request, adds_nodes, refusal, unplaceable
from rl_cluster.core.replica_history import ACTOR_DIED, NODE_LOST, REMOVED, ReplicaHistory
from rl_cluster.errors import RunRefused
from rl_cluster.generator.actor import GeneratorActor
from rl_cluster.models import hf_environment, secret_environment
from rl_cluster.proxy.actor import ProxyActor


@dataclass(frozen=True)
class RunSecrets:
    """The run's two secrets, and the driver's HF_TOKEN / WANDB_API_KEY (repr hides them: dataclasses
    print their fields in tracebacks and logs). All reach the actors as constructor arguments, which Ray's
    dashboard, job API and state API do not show (a runtime_env's env_vars they show to anyone)."""

    replica_key: str | None = field(default=None, repr=False)
    proxy_token: str | None = field(default=None, repr=False)
    environment: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def for_run(cls, config: RunConfig, generate_token: bool = True) -> RunSecrets:
        """A fresh replica key; the configured proxy token, else a fresh one when `generate_token` (a
        proxy serving only loopback may leave its control routes open to this machine)."""
        configured = config.proxy.auth_token
        token = configured.get_secret_value() if configured else None
        if token is None and generate_token:
            token = secrets.token_urlsafe(32)
        return cls(replica_key=secrets.token_urlsafe(32), proxy_token=token, environment=secret_environment())


def proxy_binds_loopback(config: RunConfig, loopback: bool) -> bool:
    """Whether the proxy listens on loopback only, as ProxyActor resolves its host (`loopback`: a private
    local Ray, where an unset host means 127.0.0.1)."""
    host = config.proxy.host
    if host is None:
        return loopback
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False  # a host name: whatever it resolves to, other machines may reach it


def write_private_file(path: str, text: str) -> None:
    """Write `text` to `path`, leaving a file only its owner can read (0600), whatever was there before.

    Opening an existing file keeps its old mode (a 0644 one stays world-readable) and follows a symlink
    planted at the path, so the text goes to a fresh file (mkstemp makes it 0600) renamed over the path.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def runtime_env() -> dict:
    return {
        "env_vars": {
            # TRL 1.16 warns on every import that it was tested with vLLM <= 0.31 (we run 0.32, verified),
            # and that its async trainer is experimental: once per process, in every actor's log.
            "TRL_EXPERIMENTAL_SILENCE": "1",
            "PYTHONWARNINGS": "ignore:TRL currently supports vLLM versions",
            "TOKENIZERS_PARALLELISM": "false",
            # Every node resolves a hub model the way the driver's environment says (cache, offline); the
            # token is no env_var here, where the dashboard shows it: RunSecrets hands it to the actors.
            **hf_environment(),
        }
    }


class Connection(NamedTuple):
    local: bool
    """True when connect() started a private local Ray: then, and only then, servers may bind loopback."""
    dashboard: str | None
    """Where that cluster's Ray dashboard answers (None: not known, or it runs without one)."""


def connect(config: RunConfig) -> Connection:
    """Join the configured or running Ray cluster; else start a private local one that declares the
    trainer and generator resources itself (a laptop has no node types)."""
    if ray.is_initialized():
        return Connection(False, None)
    if (
        not sys.stdout.isatty()
    ):  # `ray job logs`, a file, a pipe: the actors' log prefixes without ANSI colours
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    env = runtime_env()
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        return Connection(False, _dashboard(ray.init(address=address, runtime_env=env)))
    # Join a cluster started with `ray start` on this machine, but never scan for other users' Ray
    # processes (what address="auto" does when the address file is missing).
    if address is None and os.path.exists(os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")):
        try:
            return Connection(False, _dashboard(ray.init(address="auto", runtime_env=env)))
        except ConnectionError:
            pass
    context = ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        # Room for the most generators the pool controller may run (a laptop has no autoscaler).
        resources={"trainer": 1, "generator": config.generator.replica_bounds[1]},
        runtime_env=env,
    )
    return Connection(True, _dashboard(context))


def _dashboard(context) -> str | None:
    url = getattr(context, "dashboard_url", None)  # "host:port", or "" when Ray runs without one
    return f"http://{url}" if url else None


def placement_requests(config: RunConfig) -> list[Request]:
    """What each of the run's actors asks Ray for, as launch() and the trainer's options ask it."""
    proxy = {"CPU": config.proxy.num_cpus}
    here = None
    if "resources" in (options := proxy_options()):
        proxy.update(options["resources"])
    else:
        here = ray.get_runtime_context().get_node_id()
    generator = {"generator": 1, "GPU": config.generator.num_gpus}
    trainer = {"trainer": 1, "CPU": config.trainer.num_cpus, "GPU": config.trainer.num_gpus}
    return [Request("proxy", proxy, here), Request("generator", generator), Request("trainer", trainer)]


async def check_placeable(config: RunConfig, wait_for_report_s: float = 15.0) -> None:
    """RunRefused, in seconds, where no live node and no autoscaler node type can ever hold one of the
    run's actors (rl_cluster.core.placement); Ray itself would wait for ever.

    Node types: those an autoscaler published to the GCS (autoscaler v2, KubeRay), read the way Ray Train
    does (`ray._private.state`: Ray has no public API for them). Else the autoscaling status the monitor of
    every head writes: the read-only autoscaler of a plain `ray start --head` adds no node, so only the
    live nodes count; one with a cluster config (`ray up`) may add nodes whose types it does not publish,
    and then, as while no status is there yet, nothing is refused."""
    from ray._private import ray_constants
    from ray._private.state import state
    from ray.experimental.internal_kv import _internal_kv_get

    node_types: list[dict] = []
    with contextlib.suppress(Exception):
        cluster_config = state.get_cluster_config()
        node_types = [dict(g.resources) for g in cluster_config.node_group_configs if g.max_count != 0]
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    missing = unplaceable(placement_requests(config), nodes, node_types)
    if not missing:
        return
    if not node_types:
        deadline = time.monotonic() + wait_for_report_s
        while True:
            status: dict = {}
            with contextlib.suppress(Exception):
                status = json.loads(_internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS) or "{}")
            adds = adds_nodes(status.get("autoscaler_report"))
            if adds is not None or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        if adds is not False:
            return  # an autoscaler that may add nodes of types it does not say, or none known: Ray waits
    raise RunRefused(refusal(missing))


def proxy_options() -> dict:
    """A node with the `proxy` resource if the cluster has one, else the driver's own node."""
    if any(node["Alive"] and node["Resources"].get("proxy") for node in ray.nodes()):
        return {"resources": {"proxy": 1}}
    here = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=here, soft=False)}


@dataclass
class Cluster:
    config: RunConfig
    log_dir: str
    proxy: object
    proxy_url: str
    secrets: RunSecrets = field(default_factory=RunSecrets)
    loopback: bool = True
    generators: dict[str, object] = field(default_factory=dict)
    placement: dict[str, dict] = field(default_factory=dict)
    trainer: object | None = None
    pool: object | None = None  # the run's pool controller (rl_cluster.pool), once it runs
    _next_index: int = 0
    _slots: dict[str, int] = field(default_factory=dict)
    _starting: set[str] = field(default_factory=set)  # generators whose start() is under way
    restarts_seen: dict[str, int] = field(default_factory=dict)  # each one's restarts when last asked
    # Where each generator ran and the faults it came through (kept by the pool controller's copy).
    history: ReplicaHistory = field(default_factory=ReplicaHistory)

    async def add_generators(self, count: int) -> list[str]:
        """Grow generation capacity, also during training: each new generator starts its vLLM server and
        registers with the proxy, which loads every live adapter version on it before routing to it."""
        new = []
        for index in range(self._next_index, self._next_index + count):
            replica_id = f"g{index}"
            # The replica's slot picks its CPU core on a CPU host (pin_cpu_cores): the lowest one no live
            # generator holds. Its number would not do once replicas come and go: g2 started after g1 left
            # shared g0's core, and under load its vLLM worker made no progress for minutes.
            held = {self._slots[r] for r in self.generators if r in self._slots}
            self._slots[replica_id] = slot = min(set(range(len(held) + 1)) - held)
            self.generators[replica_id] = generator_actor(self, replica_id)
            new.append((replica_id, slot, self.generators[replica_id]))
        self._next_index += count
        self._starting.update(replica_id for replica_id, _, _ in new)
        try:
            await asyncio.gather(*(actor.start.remote(slot, self.proxy) for _, slot, actor in new))
            for replica_id, _, actor in new:
                await self._placed(replica_id, actor)
        finally:
            self._starting.difference_update(replica_id for replica_id, _, _ in new)
        return [replica_id for replica_id, _, _ in new]

    async def generators_to_mend(self, timeout_s: float = 60.0) -> dict[str, str]:
        """{replica: what it needs}: "restarted" when its actor died and Ray restarted it (a fresh actor,
        nothing started: see `revive`), "spent" when its server's restart budget ran out (it stays down
        until replaced). One that Ray will not restart again leaves the pool and the proxy."""
        found = {}
        for replica_id, actor in list(self.generators.items()):
            if replica_id in self._starting:
                continue
            try:
                # Retried while Ray restarts the actor; ActorDiedError once it will not come back.
                call = actor.condition.options(max_task_retries=-1).remote()
                condition = await asyncio.wait_for(call, timeout_s)
            except ray.exceptions.ActorDiedError as e:
                print(f"replica {replica_id}: its generator actor is gone for good, it leaves the pool: {e}",
                      flush=True)  # fmt: skip
                self.generators.pop(replica_id, None)
                self.history.cause(replica_id, f"{ACTOR_DIED}, not restarted again", opens=True)
                self.history.ended(replica_id, ACTOR_DIED)
                self.history.forget(replica_id)
                with contextlib.suppress(Exception):
                    await self.proxy.remove_replica.remote(replica_id, 0.0)
                continue
            except (TimeoutError, ray.exceptions.RayActorError):
                continue  # still restarting: the next round sees it
            if not condition["started"]:
                found[replica_id] = "restarted"
                continue
            if condition["restarts"] > self.restarts_seen.get(replica_id, 0):
                why = condition.get("last_restart")
                self.history.cause(
                    replica_id, f"vLLM server restarted ({why})" if why else "vLLM server restarted"
                )
            self.restarts_seen[replica_id] = condition["restarts"]
            if condition["spent"]:
                found[replica_id] = "spent"
        return found

    async def revive(self, replica_id: str) -> None:
        """Start a restarted generator actor's vLLM server again; it registers with the proxy anew (which
        replaces the dead server's entry and loads every live version before routing to it)."""
        actor = self.generators[replica_id]
        self._starting.add(replica_id)  # before any await: the next look (generators_to_mend) leaves it be
        try:
            self.restarts_seen[replica_id] = earlier = self.restarts_seen.get(replica_id, 0) + 1  # one more
            why = await asyncio.to_thread(self._why_it_died, replica_id)
            self.history.cause(replica_id, why, opens=True)
            self.history.ended(replica_id, why)
            where = await self._placed(replica_id, actor)  # its new life began where Ray restarted it
            print(f"replica {replica_id}: {why}; Ray restarted its generator actor on {where['address']}; "
                  "starting vLLM again", flush=True)  # fmt: skip
            await actor.start.remote(self._slots[replica_id], self.proxy, earlier_restarts=earlier)
        finally:
            self._starting.discard(replica_id)
        print(f"replica {replica_id}: serving again after its actor's restart", flush=True)

    async def _placed(self, replica_id: str, actor) -> dict:
        where = await actor.placement.remote()
        self.placement[f"generator {replica_id}"] = where
        self.history.placed(replica_id, where)
        return where

    def _why_it_died(self, replica_id: str) -> str:
        """NODE_LOST when the node its last life ran on is dead in Ray's node table (with Ray's reason),
        else ACTOR_DIED (its process died; the node is still there)."""
        stint = self.history.current(replica_id)
        if stint is None:
            return ACTOR_DIED
        for node in ray.nodes():
            if node["NodeID"] == stint.node_id and not node["Alive"]:
                reason = node.get("DeathReasonMessage") or ""
                return (
                    f"{NODE_LOST} ({stint.address}: {reason})" if reason else f"{NODE_LOST} ({stint.address})"
                )
        return ACTOR_DIED

    async def remove_generator(self, replica_id: str, why: str = REMOVED) -> None:
        """Shrink: the generator leaves the proxy (no new requests; in-flight ones finish), then stops."""
        actor = self.generators.pop(replica_id)
        self.history.ended(replica_id, why)
        self.history.forget(replica_id)
        try:
            await actor.shutdown.remote()
        finally:
            ray.kill(actor)

    async def _sync_from_pool(self, stop: bool = False) -> None:
        """Once the pool controller runs, its copy of this Cluster is the one whose generators change:
        take its generator set, placement, history and restart counts (and with `stop`, stop it deciding
        first)."""
        if self.pool is None:
            return
        call = self.pool.stop.remote() if stop else self.pool.members.remote()
        with contextlib.suppress(Exception):
            members = await asyncio.wait_for(call, 30)
            self.generators, self.history = members["generators"], members["history"]
            self.placement.update(members["placement"])
            self.restarts_seen.update(members["restarts_seen"])

    async def replica_restarts(self) -> dict[str, int]:
        """Restarts of each replica so far: its vLLM server's and its actor's. A generator that does not
        answer counts what the pool controller last saw of it."""
        await self._sync_from_pool()
        counts = await asyncio.gather(
            *(asyncio.wait_for(g.restart_count.remote(), 10) for g in self.generators.values()),
            return_exceptions=True,
        )
        return {
            rid: n if isinstance(n, int) else self.restarts_seen.get(rid, 0)
            for rid, n in zip(self.generators, counts, strict=True)
        }

    async def replica_reports(self, fresh: bool = True) -> dict[str, dict]:
        """Each generator's own record of the run (GeneratorActor.report: vLLM's prefix-cache counters, the
        versions it loaded); a generator that does not answer is left out."""
        await self._sync_from_pool()
        reports = await asyncio.gather(
            *(asyncio.wait_for(g.report.remote(fresh), 10) for g in self.generators.values()),
            return_exceptions=True,
        )
        return {rid: r for rid, r in zip(self.generators, reports, strict=True) if isinstance(r, dict)}

    async def restore_proxy(self) -> str:
        """Hand a proxy Ray restarted its generators, on the port its predecessor had; returns its URL."""
        port = urllib.parse.urlsplit(self.proxy_url).port
        answers = await asyncio.gather(
            *(asyncio.wait_for(g.membership.remote(), 30) for g in self.generators.values()),
            return_exceptions=True,
        )
        # One without a server (starting, restarting, its actor gone) registers by itself when it has one.
        members = {rid: m for rid, m in zip(self.generators, answers, strict=True) if isinstance(m, tuple)}
        url = await self.proxy.restore.remote(port, members)
        print(f"proxy restarted by Ray: serving again on {url} with {sorted(members)}", flush=True)
        return url

    async def shutdown(self) -> None:
        """Generators leave the proxy and stop their vLLM servers, then the proxy stops, then the actors
        are killed. Best effort at each stage: a failure must not leave the rest running."""
        await self._sync_from_pool(stop=True)
        stops = [g.shutdown.remote() for g in self.generators.values()]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), timeout=90)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proxy.stop.remote(), timeout=10)
        for actor in [*self.generators.values(), self.proxy, self.trainer, self.pool]:
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)


def draining_nodes() -> dict[str, float | None]:
    """Node id -> its drain's deadline (Unix time; None: none given) for every node Ray is draining: `ray
    drain-node`, or an autoscaler that got a spot termination notice. Ray has no public API for it; this
    reads it the way Ray Serve and Ray Data do (`ray._private.state`)."""
    from ray._private.state import state

    return {node: ms / 1000 if ms else None for node, ms in state.get_draining_nodes().items()}


def generator_actor(cluster: Cluster, replica_id: str):
    config = cluster.config
    return GeneratorActor.options(
        name=f"{config.run_name}-generator-{replica_id}",
        # A generator actor that dies (its process crashed, its node went) is restarted by Ray, and the
        # pool controller starts its server again (Cluster.revive); calls in flight then fail, not repeat.
        max_restarts=config.generator.max_restarts,
        num_cpus=0,
        num_gpus=config.generator.num_gpus,
        resources={"generator": 1},
    ).remote(
        replica_id,
        config,
        cluster.log_dir,
        api_key=cluster.secrets.replica_key,
        loopback=cluster.loopback,
        environment=cluster.secrets.environment,
    )


async def launch(
    config: RunConfig, log_dir: str, secrets: RunSecrets | None = None, loopback: bool = True
) -> Cluster:
    """Start the proxy and the generators; return once every generator serves through the proxy.
    `secrets` None starts replicas without a key and a proxy without a token (loopback-only tests)."""
    cluster = await start_proxy(config, log_dir, secrets, loopback)
    try:
        await cluster.add_generators(config.generator.replicas)
    except BaseException:
        await cluster.shutdown()
        raise
    return cluster


async def start_proxy(
    config: RunConfig, log_dir: str, secrets: RunSecrets | None = None, loopback: bool = True
) -> Cluster:
    """The run's cluster with its proxy serving and no generator yet (`launch` adds them)."""
    secrets = secrets or RunSecrets()
    # The proxy refuses adapter paths outside the bucket before any replica sees them.
    adapter_root = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url).uri
    proxy = ProxyActor.options(
        name=f"{config.run_name}-proxy",
        num_cpus=config.proxy.num_cpus,
        # A proxy whose process died is restarted where it was; calls made meanwhile wait for it.
        max_restarts=config.proxy.max_restarts,
        max_task_retries=-1 if config.proxy.max_restarts else 0,
        **proxy_options(),
    ).remote(
        config.proxy,
        adapter_root=adapter_root,
        replica_key=secrets.replica_key,
        auth_token=secrets.proxy_token,
        loopback=loopback,
        run_name=config.run_name,
        max_model_len=config.model.max_model_len,
    )
    cluster = Cluster(
        config=config,
        log_dir=log_dir,
        proxy=proxy,
        proxy_url=await proxy.start.remote(),
        secrets=secrets,
        loopback=loopback,
    )
    cluster.placement["proxy"] = await proxy.placement.remote()
    return cluster
