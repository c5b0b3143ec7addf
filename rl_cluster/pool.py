"""The pool controller: the run's named actor that grows and shrinks its generator pool.

Every `generator.scale_interval_s` it reads the proxy's per-replica counts (state, in flight, requests
routed), asks the policy (rl_cluster.core.scaling) what to do, and does it with the run's Cluster:

- **grow**: `Cluster.add_generators`. A generator actor needs the `generator` resource; when no node
  has one free, the actor waits and Ray's autoscaler adds a `generator` node for it. The new replica
  registers with the proxy, which loads every live adapter version on it before it routes to it
  (rl_cluster.proxy.replicas: catch-up under the adapter lock, `VersionBook.activate` refuses a replica
  that lacks a routable version), so a replica never serves a version it did not load.
- **shrink**: drain in the proxy (no new requests; in-flight ones finish, bounded by
  `generator.drain_timeout_s`), then `Cluster.remove_generator` (it leaves the proxy, its vLLM stops, the
  actor is killed); the autoscaler removes the node once it idles.
- **replace**: a replica whose node Ray is draining (`ray drain-node`, the autoscaler's answer to a spot
  termination notice) is shrunk before the drain's deadline and a new generator is started at once; Ray
  places nothing new on a draining node, so it lands elsewhere (or on a node the autoscaler adds).
- **mend**: a generator actor Ray restarted (its process died, its node was lost) gets its vLLM started
  again (`Cluster.revive`); every spell out of routing is recorded (rl_cluster.core.replica_history).

It lives on the driver's node: an actor on a generator node would keep that node busy, and the
autoscaler could never take it away. Operators reach it by name (`jobs/scale.py --run RUN --replicas N`,
rl_cluster.scale); the driver asks it at the end for the generators it has and for the scale events
(summary.json's `scale_events`). Every scale event is also printed, so it reaches the job's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rl_cluster.cluster import draining_nodes
from rl_cluster.config import GeneratorConfig
from rl_cluster.core.replica_history import NODE_DRAINED, REMOVED
from rl_cluster.core.scaling import (
    Decision,
    PoolSnapshot,
    ReplicaLoad,
    ScaleEvent,
    ScalingPolicy,
    ScalingRules,
)

logger = logging.getLogger(__name__)

# Named actors live in a namespace; a driver gets an anonymous one unless it names one, so the pool is
# registered under a fixed one that `jobs/scale.py` (another driver) can look in.
NAMESPACE = "rl_cluster"
FIRST_REQUEST_POLL_S = 0.25
# A drained replica's requests must be done this long before its node's deadline (its vLLM must stop
# and leave the proxy while the node is still there).
DRAIN_MARGIN_S = 10.0
# Proxy states of a replica on its way in (registered, loading the live versions) and of one that is out
# for now but comes back by itself (its server is being restarted).
ARRIVING = ("joining", "catching_up")
OUT_FOR_NOW = ("unhealthy",)


def pool_actor_name(run_name: str) -> str:
    return f"{run_name}-pool"


def rules_for(g: GeneratorConfig) -> ScalingRules:
    low, high = g.replica_bounds
    return ScalingRules(
        min_replicas=low,
        max_replicas=high,
        up_in_flight=g.scale_up_in_flight,
        up_window_s=g.scale_up_window_s,
        down_window_s=g.scale_down_window_s,
        cooldown_s=g.scale_cooldown_s,
    )


def snapshot(
    generators, stats: dict, now: float, leaving: set[str], replacing: int
) -> tuple[PoolSnapshot, dict]:
    """The policy's view of the run's `generators`, in the order they joined (replicas the proxy has from
    elsewhere are not the pool's to count or stop), from the proxy's `stats`. `leaving`: replicas on their
    way out; `replacing`: replacements of drained replicas, counted before their actors exist."""
    proxy_view = stats.get("replicas", {})
    serving: dict[str, ReplicaLoad] = {}
    starting, out, gone = [], [], []
    for rid in generators:
        state = proxy_view.get(rid, {}).get("state")
        if rid in leaving:
            gone.append(rid)
        elif state == "active":
            serving[rid] = ReplicaLoad(proxy_view[rid]["in_flight"], proxy_view[rid]["requests"])
        elif state in OUT_FOR_NOW:
            out.append(rid)
        elif state is None or state in ARRIVING:
            starting.append(rid)  # waiting for a node, starting vLLM, or catching up
    snap = PoolSnapshot(now, serving, starting=len(starting) + replacing, unavailable=len(out),
                        queued=stats.get("queued", 0))  # fmt: skip
    return snap, {"serving": list(serving), "starting": starting, "unavailable": out, "leaving": gone}


async def first_request(proxy, new: list[str], event: ScaleEvent, decided: float) -> None:
    """Watch (finely: it is what a scale-out is measured by) until a new replica got a request."""
    while True:
        replicas = (await proxy.stats.remote())["replicas"]
        if any(replicas.get(rid, {}).get("requests") for rid in new):
            event.first_request_s = round(time.monotonic() - decided, 3)
            print(f"pool: {new} served a first request {event.first_request_s:.1f} s after the decision",
                  flush=True)  # fmt: skip
            return
        if not any(rid in replicas for rid in new):
            return  # removed before anything was routed to it
        await asyncio.sleep(FIRST_REQUEST_POLL_S)


async def discard(cluster, rid: str) -> None:
    """A generator that never came up: kill it (a pending one just stops waiting for a node) and make sure
    the proxy forgets it (it may have registered and be catching up)."""
    actor = cluster.generators.pop(rid, None)
    if actor is not None:
        ray.kill(actor)
    with contextlib.suppress(Exception):
        await cluster.proxy.remove_replica.remote(rid, 0.0)


class PoolController:
    def __init__(self, cluster):
        """`cluster`: the run's rl_cluster.cluster.Cluster after launch (proxy and first generators up).
        From here on this copy of it is the one whose generator set changes."""
        self.cluster = cluster
        self.g = cluster.config.generator
        self.policy = ScalingPolicy(rules_for(self.g))
        self.events: list[ScaleEvent] = []
        self._leaving: set[str] = set()
        # Replicas leaving a draining node whose replacement is on its way: the policy counts them as
        # starting, or it would see a hole and add a second replacement.
        self._replacing: set[str] = set()
        self._growing = asyncio.Lock()  # one add at a time: the actors it creates are then known
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None  # the current look after the generators (_mend)
        self.proxy_restores = 0  # proxies Ray restarted that this controller handed the generators

    # -- the actor's interface ----------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop().create_task(self._run())

    async def set_target(self, replicas: int | None) -> dict:
        """Pin the pool at `replicas` (None: hand it back to the policy); acts at once. Raises ValueError
        outside [generator.min_replicas, generator.max_replicas]."""
        self.policy.set_target(replicas)
        print(f"pool: {'target set to ' + str(replicas) if replicas else 'automatic again'}", flush=True)
        await self.step()
        return await self.status()

    async def status(self) -> dict:
        """Mode, bounds, replicas by condition, and every scale event so far."""
        stats = await self.cluster.proxy.stats.remote()
        snap, by_state = self._snapshot(stats)
        low, high = self.policy.rules.min_replicas, self.policy.rules.max_replicas
        return {
            "mode": "automatic" if self.policy.manual_target is None else "manual",
            "target": self.policy.manual_target,
            "min_replicas": low,
            "max_replicas": high,
            "size": snap.size,
            **by_state,
            "events": await self.scale_events(),
        }

    async def pool_size(self) -> int:
        """Replicas serving now: what generation throughput (and TRL's pipeline limits) can count on."""
        stats = await self.cluster.proxy.stats.remote()
        return len(self._snapshot(stats)[0].serving)

    async def proxy_restarts(self) -> int:
        """How often the proxy was restarted (and restored) so far: summary.json's proxy_restarts."""
        return self.proxy_restores

    async def scale_events(self) -> list[dict]:
        return [event.as_dict() for event in self.events]

    async def members(self) -> dict:
        """What the driver reports and shuts down: `generators` (replica id -> actor), `placement`,
        `history` (rl_cluster.core.replica_history.ReplicaHistory), `restarts_seen` (replica -> count)."""
        c = self.cluster
        return {"generators": dict(c.generators), "placement": dict(c.placement), "history": c.history,
                "restarts_seen": dict(c.restarts_seen)}  # fmt: skip

    async def stop(self) -> dict:
        """Stop deciding; give up generators still waiting to start (pending actors would keep the
        autoscaler adding nodes); return members() for the driver's shutdown."""
        for task in (self._loop, self._watch):
            if task is not None:
                task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        return await self.members()

    # -- sampling and deciding ----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if self._watch is None or self._watch.done():
                self._watch = asyncio.get_running_loop().create_task(self._mend())
            try:
                asked = time.time()  # a call to a dead proxy waits here until Ray restarted it
                if await self.cluster.proxy.awaiting_restore.remote():
                    # Ray restarted the proxy (its process died): only this actor knows the generators.
                    async with self._growing:  # not while an add registers a generator with it
                        await self.cluster.restore_proxy()
                    self.proxy_restores += 1
                    self.cluster.history.record("proxy", "proxy restarted by Ray", asked, time.time() - asked)
                await self._evacuate_draining()
                await self.step()
            except Exception:
                logger.exception("pool controller step failed")
            await asyncio.sleep(self.g.scale_interval_s)

    async def _mend(self) -> None:
        """Generators whose actor Ray restarted after it died start serving again, each in its own task
        (a vLLM start takes a while and the pool keeps deciding meanwhile); ones whose restart budget is
        spent stop, and the policy adds a replica if the pool falls below min_replicas (one counted as
        coming back would never be replaced)."""
        try:
            needs = await self.cluster.generators_to_mend()
        except Exception:
            logger.exception("looking after the generators failed")
            return
        for rid, need in needs.items():
            if rid in self._leaving:
                continue
            if need == "restarted":
                self._spawn(self._revive(rid))
            else:
                print(f"pool: {rid} spent its restart budget; it leaves the pool", flush=True)
                self._leave(rid)

    async def _evacuate_draining(self) -> None:
        """Replicas on a node Ray is draining leave it before its deadline, each replaced at once."""
        draining = await asyncio.to_thread(draining_nodes)
        for rid in list(self.cluster.generators):
            stint = self.cluster.history.current(rid)
            if stint is not None and stint.node_id in draining and rid not in self._leaving:
                self._leaving.add(rid)
                self._replacing.add(rid)
                self._spawn(self._replace(rid, stint.address, draining[stint.node_id]))

    async def _replace(self, rid: str, address: str, deadline: float | None) -> None:
        """Start a replacement and drain `rid` at once (its in-flight requests finish, bounded so that it
        stops DRAIN_MARGIN_S before the deadline); the fault is recorded with the replacement's start."""
        now, decided = time.time(), time.monotonic()
        left = None if deadline is None else deadline - now
        budget = (
            self.g.drain_timeout_s
            if left is None
            else max(0.0, min(self.g.drain_timeout_s, left - DRAIN_MARGIN_S))
        )
        size = len(self.cluster.generators) - len(self._leaving) + 1
        notice = f"its node {address} is draining" + (
            f" (deadline in {left:.0f} s)" if left is not None else ""
        )
        event = ScaleEvent(now, size, size, f"{rid} replaced: {notice}", replicas=[rid])
        self.events.append(event)
        print(f"pool: {rid} leaves: {notice}; a replacement starts now", flush=True)
        fault = self.cluster.history.record(rid, f"{NODE_DRAINED} ({address})", now, None)
        try:
            await asyncio.gather(
                self._grow(1, event, decided), self._shrink(rid, event, decided, budget, NODE_DRAINED)
            )
        finally:
            self._replacing.discard(rid)
        fault.recovered_s = event.ready_s

    def _leave(self, rid: str) -> None:
        self._leaving.add(rid)
        self._spawn(self._retire(rid))

    async def _retire(self, rid: str) -> None:
        try:
            await self.cluster.remove_generator(rid)
        except Exception as e:
            print(f"pool: stopping {rid} failed: {type(e).__name__}: {e}", flush=True)
        finally:
            self._leaving.discard(rid)

    async def _revive(self, rid: str) -> None:
        try:
            await self.cluster.revive(rid)
        except Exception as e:  # it stays registered nowhere; a replacement comes from the policy
            print(f"pool: restarting {rid} failed, it leaves the pool: {type(e).__name__}: {e}", flush=True)
            self._leave(rid)

    async def step(self) -> Decision | None:
        stats = await self.cluster.proxy.stats.remote()
        snap, by_state = self._snapshot(stats)
        if stats.get("serving", True):  # a proxy awaiting its restore knows no replica yet
            replicas = stats.get("replicas", {})
            for rid in (*by_state["serving"], *by_state["starting"], *by_state["unavailable"]):
                why = replicas.get(rid, {}).get("down_reason")
                self.cluster.history.observe(rid, serving=rid in snap.serving, why=why)
        decision = self.policy.observe(snap)
        if decision is not None:
            self._apply(decision, snap.size)
        return decision

    def _snapshot(self, stats: dict) -> tuple[PoolSnapshot, dict]:
        return snapshot(self.cluster.generators, stats, time.monotonic(), self._leaving, len(self._replacing))

    def _apply(self, decision: Decision, size: int) -> None:
        event = ScaleEvent(time.time(), size, size + decision.add - len(decision.remove), decision.reason)
        self.events.append(event)
        print(f"pool: {event.from_replicas} -> {event.to_replicas} replicas ({event.reason})", flush=True)
        if decision.add:
            self._spawn(self._grow(decision.add, event, time.monotonic()))
        for rid in decision.remove:
            self._leaving.add(rid)
            event.replicas.append(rid)
            self._spawn(self._shrink(rid, event, time.monotonic()))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- doing it -----------------------------------------------------------------------------------

    async def _grow(self, count: int, event: ScaleEvent, decided: float) -> None:
        async with self._growing:
            before = set(self.cluster.generators)
            adding = asyncio.ensure_future(self.cluster.add_generators(count))
            await asyncio.sleep(0)  # add_generators creates its actors before its first await
            new = [rid for rid in self.cluster.generators if rid not in before]
            event.replicas.extend(new)
            try:
                await asyncio.wait_for(adding, self.g.scale_up_timeout_s)
            except BaseException as e:  # timed out (no node came), failed to start, or the run ends
                event.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                print(f"pool: adding {new} failed: {event.error}; given up", flush=True)
                await asyncio.gather(*(discard(self.cluster, rid) for rid in new), return_exceptions=True)
                if isinstance(e, asyncio.CancelledError):
                    raise
                return
        event.ready_s = round(time.monotonic() - decided, 3)
        print(f"pool: {new} caught up and active {event.ready_s:.1f} s after the decision", flush=True)
        await first_request(self.cluster.proxy, new, event, decided)

    async def _shrink(self, rid: str, event: ScaleEvent, decided: float, timeout_s: float | None = None,
                      why: str = REMOVED) -> None:  # fmt: skip
        try:
            timeout_s = self.g.drain_timeout_s if timeout_s is None else timeout_s
            drained = await self.cluster.proxy.drain_replica.remote(rid, timeout_s)
            # It left routing and nothing is in flight (or the drain timed out): leave the proxy, stop.
            await self.cluster.remove_generator(rid, why)
            event.drain[rid] = {
                "in_flight_at_start": drained["in_flight_at_start"],
                "in_flight_left": drained["in_flight_left"],
                "drain_s": round(drained["drain_s"], 3),
                "stopped_s": round(time.monotonic() - decided, 3),
            }
            print(f"pool: {rid} drained in {drained['drain_s']:.1f} s ({drained['in_flight_at_start']} in "
                  f"flight when it began, {drained['in_flight_left']} left) and stopped", flush=True)  # fmt: skip
        except Exception as e:
            event.error = f"removing {rid}: {type(e).__name__}: {e}"
            print(f"pool: {event.error}", flush=True)
        finally:
            self._leaving.discard(rid)


PoolActor = ray.remote(PoolController)


async def start_pool(cluster) -> object:
    """Start the run's pool controller, pinned to the driver's node; returns its handle."""
    here = ray.get_runtime_context().get_node_id()
    actor = PoolActor.options(
        name=pool_actor_name(cluster.config.run_name),
        namespace=NAMESPACE,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
    ).remote(cluster)
    await actor.start.remote()
    return actor
