"""The run's actors: where they start, in what order, how they are mended and shut down.

Placement (rl_cluster.connection): the trainer on a `trainer` node, one generator per `generator`
resource, the proxy on a `proxy` node or pinned to the driver's. The run's secrets
(rl_cluster.credentials) reach the actors as constructor arguments.

Addressing: every server an actor starts binds, and advertises, its own node's address
(`ray.util.get_node_ip_address()`), because on a cluster the trainer and the generators are on other
nodes; loopback only when the driver started a private local Ray itself (nothing else can join it).
URLs travel through Ray (actor return values), never through config files.

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
import urllib.parse
from dataclasses import dataclass, field

import ray

from rl_cluster.bucket import Bucket
from rl_cluster.config import RunConfig
from rl_cluster.connection import proxy_options
from rl_cluster.core.names import NAMESPACE, generator_actor_name
from rl_cluster.core.replica_history import ACTOR_DIED, NODE_LOST, REMOVED, ReplicaHistory
from rl_cluster.credentials import RunSecrets
from rl_cluster.generator.actor import GeneratorActor
from rl_cluster.pool_state import stop_generators
from rl_cluster.proxy.actor import ProxyActor
from rl_cluster.proxy.replica import Member


@dataclass
class Cluster:
    config: RunConfig
    log_dir: str
    proxy: object
    proxy_url: str
    secrets: RunSecrets = field(default_factory=RunSecrets)
    loopback: bool = True
    # Placed by the `proxy` resource, so Ray may restart it on another such node; else pinned to the driver's.
    proxy_movable: bool = False
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
            # The replica's slot: the lowest no live generator holds. On a CPU host a replica claims free
            # cores of its node (rl_cluster.generator.cores) and falls back to its slot's when none is
            # free; its number would not do once replicas come and go (g2 started after g1 left shared
            # g0's core, and under load its vLLM worker made no progress for minutes).
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
            if not condition.started:
                found[replica_id] = "restarted"
                continue
            if condition.restarts > self.restarts_seen.get(replica_id, 0):
                why = condition.last_restart
                self.history.cause(
                    replica_id, f"vLLM server restarted ({why})" if why else "vLLM server restarted"
                )
            self.restarts_seen[replica_id] = condition.restarts
            if condition.spent:
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
        """Hand a proxy Ray restarted its generators, on the port its predecessor had; returns its URL. A
        generator that does not say where it serves within 30 s (its actor restarting, cut off, busy) is
        handed over by name: the proxy registers it down and asks it again each health round, so it is
        never left out for good."""
        port = urllib.parse.urlsplit(self.proxy_url).port
        answers = await asyncio.gather(
            *(asyncio.wait_for(g.membership.remote(), 30) for g in self.generators.values()),
            return_exceptions=True,
        )
        members, unreached = {}, {}
        for rid, answer in zip(self.generators, answers, strict=True):
            if isinstance(answer, tuple):
                members[rid] = Member(*answer)
            elif rid not in self._starting:  # one being started registers by itself once it serves
                unreached[rid] = "no server yet" if answer is None else f"{type(answer).__name__}: {answer}"
        url = self.proxy_url = await self.proxy.restore.remote(port, members, unreached)
        # Ray restarts it on another `proxy` node when its own was lost: the summary says where it ended.
        self.placement["proxy"] = await self.proxy.placement.remote()
        print(f"proxy restarted by Ray: serving again on {url} with {sorted(members)}"
              + (f"; out of routing until they answer: {sorted(unreached)}" if unreached else ""),
              flush=True)  # fmt: skip
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
        # Detached: also any this copy does not know (started by a pool controller that died for good).
        with contextlib.suppress(Exception):
            await stop_generators(self.config.run_name)


def draining_nodes() -> dict[str, float | None]:
    """Node id -> its drain's deadline (Unix time; None: none given) for every node Ray is draining: `ray
    drain-node`, or an autoscaler that got a spot termination notice. Ray has no public API for it; this
    reads it the way Ray Serve and Ray Data do (`ray._private.state`)."""
    from ray._private.state import state

    return {node: ms / 1000 if ms else None for node, ms in state.get_draining_nodes().items()}


def proxy_node_besides(node_id: str, draining: dict) -> str | None:
    """The address of a live node with the `proxy` resource, neither `node_id` nor draining: where Ray can
    restart the proxy. None when there is none."""
    for node in ray.nodes():
        if node["Alive"] and node["Resources"].get("proxy") and node["NodeID"] not in {node_id, *draining}:
            return node["NodeManagerAddress"]
    return None


def generator_actor(cluster: Cluster, replica_id: str):
    config = cluster.config
    return GeneratorActor.options(
        name=generator_actor_name(config.run_name, replica_id),
        namespace=NAMESPACE,
        # Not a child of whoever starts it (an actor's children die with it): the pool controller, which
        # starts most of them, may die and be restarted by Ray; it then takes them over by name. The driver
        # stops them by name when the run ends, and a generator whose run's proxy is gone for good ends
        # itself (rl_cluster.pool_state, rl_cluster.generator.run_watch).
        lifetime="detached",
        # A generator actor that dies (its process crashed, its node went) is restarted by Ray, and the
        # pool controller starts its server again (Cluster.revive); calls in flight then fail, not repeat.
        max_restarts=config.generator.max_restarts,
        num_cpus=0,
        num_gpus=config.generator.num_gpus,
        # Its devices: a node with `generator: K` holds K // tensor_parallel_size replicas.
        resources={"generator": config.generator.tensor_parallel_size},
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
    # A driver of this run that was killed left its generators (detached actors) running: stopped first
    # (under the run's lease, for a training run), as new ones get their names.
    if left := await stop_generators(config.run_name):
        print(f"run {config.run_name}: stopped generators {left} an earlier driver left running", flush=True)
    secrets = secrets or RunSecrets()
    # The proxy refuses adapter paths outside the bucket before any replica sees them.
    adapter_root = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url).uri
    placed = proxy_options()
    proxy = ProxyActor.options(
        name=f"{config.run_name}-proxy",
        num_cpus=config.proxy.num_cpus,
        # A proxy whose process died is restarted where it was; calls made meanwhile wait for it.
        max_restarts=config.proxy.max_restarts,
        max_task_retries=-1 if config.proxy.max_restarts else 0,
        **placed,
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
        proxy_movable="resources" in placed,
    )
    cluster.placement["proxy"] = await proxy.placement.remote()
    return cluster
