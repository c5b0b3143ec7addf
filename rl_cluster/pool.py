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
  places nothing new on a draining node, so it lands elsewhere (or on a node the autoscaler adds). At
  most one replacement per replica, never past max_replicas (rl_cluster.core.replacement); a replica
  whose drain fails is stopped all the same (its node is going).
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
from dataclasses import asdict

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rl_cluster.cluster import draining_nodes, proxy_node_besides
from rl_cluster.config import GeneratorConfig
from rl_cluster.core.names import NAMESPACE, pool_actor_name
from rl_cluster.core.replacement import Replacements, evacuation
from rl_cluster.core.replica_history import NODE_DRAINED, REMOVED
from rl_cluster.core.scaling import (
    Decision,
    PoolSnapshot,
    ScaleEvent,
    ScalingPolicy,
    ScalingRules,
    snapshot,
)
from rl_cluster.pool_state import Leaving, RecordKeeper, Restarts, Succession

logger = logging.getLogger(__name__)

FIRST_REQUEST_POLL_S = 0.25
# A new replica that gets no request for a while (a pool with no clients: `serve` idle) is watched less
# often, then no more: each scale-out's watch would otherwise ask the proxy 4 times a second for ever.
FIRST_REQUEST_FINE_S = 60.0
FIRST_REQUEST_COARSE_POLL_S = 5.0
FIRST_REQUEST_MAX_S = 1800.0


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


async def first_request(proxy, new: list[str], event: ScaleEvent, decided: float) -> None:
    """Watch (finely: it is what a scale-out is measured by) until a new replica got a request; coarsely
    after FIRST_REQUEST_FINE_S, and not past FIRST_REQUEST_MAX_S (first_request_s stays None)."""
    began = time.monotonic()
    while (watched := time.monotonic() - began) < FIRST_REQUEST_MAX_S:
        replicas = (await proxy.stats.remote())["replicas"]
        if any(replicas.get(rid, {}).get("requests") for rid in new):
            event.first_request_s = round(time.monotonic() - decided, 3)
            print(f"pool: {new} served a first request {event.first_request_s:.1f} s after the decision",
                  flush=True)  # fmt: skip
            return
        if not any(rid in replicas for rid in new):
            return  # removed before anything was routed to it
        await asyncio.sleep(
            FIRST_REQUEST_POLL_S if watched < FIRST_REQUEST_FINE_S else FIRST_REQUEST_COARSE_POLL_S
        )


async def discard(cluster, rid: str) -> None:
    """A generator that never came up: kill it (a pending one just stops waiting for a node) and make sure
    the proxy forgets it (it may have registered and be catching up)."""
    actor = cluster.generators.pop(rid, None)
    if actor is not None:
        ray.kill(actor)
    with contextlib.suppress(Exception):
        await cluster.proxy.remove_replica.remote(rid, 0.0)


async def move_proxy_off_draining(cluster, moved_off: set[str]) -> None:
    """The proxy's node is draining (a preemption notice): Ray restarts the proxy on another `proxy` node
    now, before the deadline, and the pool controller restores it there as after a lost node (the trainer
    and its rollout child follow it). Not a proxy pinned to the driver's node, nor one no other live `proxy`
    node could take: it stays, and is restarted when its node goes. `moved_off`: nodes it was asked off."""
    node = cluster.placement.get("proxy", {}).get("node_id")
    if not cluster.proxy_movable or node in moved_off:
        return
    draining = await asyncio.to_thread(draining_nodes)
    if (
        node not in draining
        or (elsewhere := await asyncio.to_thread(proxy_node_besides, node, draining)) is None
    ):
        return
    moved_off.add(node)
    address = cluster.placement["proxy"].get("address")
    print(f"pool: the proxy's node {address} is draining: Ray restarts the proxy on {elsewhere}", flush=True)
    ray.kill(cluster.proxy, no_restart=False)


class PoolController:
    def __init__(self, cluster, keeper: RecordKeeper | None = None):
        """`cluster`: the run's Cluster after launch, from here on the copy whose generators change."""
        self.cluster, self.g = cluster, cluster.config.generator
        self.policy = ScalingPolicy(rules_for(self.g))
        self.events: list[ScaleEvent] = []
        self._leaving: dict[str, Leaving] = {}  # kept for a successor, which finishes their way out
        self.replacements = Replacements(self.policy.rules.max_replicas)  # of replicas on draining nodes
        # One add at a time, so the actors an add creates are known. Only adds take it: a proxy restore
        # must never wait behind an add, which can wait up to generator.scale_up_timeout_s for a node.
        self._growing = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None  # the current look after the generators (_mend)
        self.proxy_restores = 0  # proxies Ray restarted that this controller handed the generators
        self._proxy_moved_off: set[str] = set()  # draining nodes the proxy was asked off
        self.restarts = 0  # of this controller, by Ray (its process died)
        self._succession = Succession(self, keeper)  # a restarted one takes its predecessor's place here

    # -- the actor's interface ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._loop is not None:  # asked twice: Ray may deliver a call it retried across a restart twice
            return
        await self._succession.begin()
        self._loop = asyncio.get_running_loop().create_task(self._run())

    async def set_target(self, replicas: int | None) -> dict:
        """Pin the pool at `replicas` (None: automatic again), at once; ValueError outside min..max_replicas."""
        self.policy.set_target(replicas)
        print(f"pool: {'target set to ' + str(replicas) if replicas else 'automatic again'}", flush=True)
        await self.step()
        status = await self.status()
        self._succession.keep()  # an operator's target survives a restart from now on, not from next round
        return status

    async def status(self) -> dict:
        """Mode, bounds, replicas by condition, every scale event so far, Ray's restarts of proxy and pool."""
        snap, by_state = self._snapshot(await self.cluster.proxy.stats.remote())
        rules, target = self.policy.rules, self.policy.manual_target
        return {"mode": "automatic" if target is None else "manual", "target": target,
                "min_replicas": rules.min_replicas, "max_replicas": rules.max_replicas, "size": snap.size,
                **by_state, "events": await self.scale_events(),
                "restarts": asdict(await self.restarts_so_far())}  # fmt: skip

    async def restarts_so_far(self) -> Restarts:
        """summary.json's proxy_restarts (each restored here) and pool_restarts (of this controller)."""
        return Restarts(proxy=self.proxy_restores, pool=self.restarts)

    async def scale_events(self) -> list[dict]:
        return [event.as_dict() for event in self.events]

    async def members(self) -> dict:
        """For the driver's report and shutdown: generators, placement, history, restarts_seen (by replica)."""
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
        self._succession.end()
        return await self.members()

    # -- sampling and deciding ----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if self._watch is None or self._watch.done():
                self._watch = asyncio.get_running_loop().create_task(self._mend())
            try:
                # First: a moved proxy is timed from its move (else its restore alone: 0.0 s once rounded).
                await move_proxy_off_draining(self.cluster, self._proxy_moved_off)
                asked = time.time()  # a call to a dead proxy waits here until Ray restarted it
                if await self.cluster.proxy.awaiting_restore.remote():
                    # Ray restarted the proxy (its process died): only this actor knows the generators.
                    # Not under _growing (see __init__): one an add starts registers by itself.
                    await self.cluster.restore_proxy()
                    self.proxy_restores += 1
                    self.cluster.history.record("proxy", "proxy restarted by Ray", asked, time.time() - asked)
                await self._evacuate_draining()
                await self.step()
                self._succession.keep()
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
        """Replicas on a node Ray is draining leave it before its deadline, each replaced at once (once
        per replica, within max_replicas: rl_cluster.core.replacement)."""
        draining = await asyncio.to_thread(draining_nodes)
        for rid in list(self.cluster.generators):
            stint = self.cluster.history.current(rid)
            if stint is not None and stint.node_id in draining and rid not in self._leaving:
                self._leaving[rid] = Leaving(NODE_DRAINED, stop_anyway=True)
                replace = self.replacements.grant(rid, len(self.cluster.generators) - len(self._leaving))
                self._spawn(self._replace(rid, stint.address, draining[stint.node_id], replace))

    async def _replace(self, rid: str, address: str, deadline: float | None, replace: bool = True) -> None:
        """Start a replacement (unless `replace` is False: it had one, or there is no room) and drain `rid`
        at once (rl_cluster.core.replacement.evacuation bounds it); the fault is recorded with the
        replacement's start."""
        now, decided = time.time(), time.monotonic()
        size = len(self.cluster.generators) - len(self._leaving) + 1
        event, budget, notice = evacuation(rid, address, deadline, now, self.g.drain_timeout_s, size, replace)
        self.events.append(event)
        self._leaving[rid] = Leaving(NODE_DRAINED, len(self.events) - 1, now + budget, stop_anyway=True)
        then = "a replacement starts now" if replace else "no replacement (it had one, or max_replicas)"
        print(f"pool: {rid} leaves: {notice}; {then}", flush=True)
        fault = self.cluster.history.record(rid, f"{NODE_DRAINED} ({address})", now, None)
        shrink = self._shrink(rid, event, decided, budget, NODE_DRAINED, stop_anyway=True)
        try:
            if replace:
                made = self.replacements.pending[rid]
                await asyncio.gather(self._grow(1, event, decided, made=made), shrink)
            else:
                await shrink
        finally:
            self.replacements.done(rid)
        fault.recovered_s = event.ready_s

    def _leave(self, rid: str) -> None:
        self._leaving[rid] = Leaving("restart budget spent")
        self._spawn(self._retire(rid))

    async def _retire(self, rid: str) -> None:
        try:
            await self.cluster.remove_generator(rid)
        except Exception as e:
            print(f"pool: stopping {rid} failed: {type(e).__name__}: {e}", flush=True)
        finally:
            self._leaving.pop(rid, None)

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
        unstarted = self.replacements.unstarted()
        return snapshot(self.cluster.generators, stats, time.monotonic(), self._leaving, unstarted)

    def _apply(self, decision: Decision, size: int) -> None:
        event = ScaleEvent(time.time(), size, size + decision.add - len(decision.remove), decision.reason)
        self.events.append(event)
        print(f"pool: {event.from_replicas} -> {event.to_replicas} replicas ({event.reason})", flush=True)
        if decision.add:
            self._spawn(self._grow(decision.add, event, time.monotonic()))
        for rid in decision.remove:
            self._leaving[rid] = Leaving(REMOVED, len(self.events) - 1)
            event.replicas.append(rid)
            self._spawn(self._shrink(rid, event, time.monotonic()))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- doing it -----------------------------------------------------------------------------------

    async def _grow(
        self, count: int, event: ScaleEvent, decided: float, made: list[str] | None = None
    ) -> None:
        """Add `count` generators; `made` (a replacement's pending entry) gets their ids once they exist."""
        async with self._growing:
            before = set(self.cluster.generators)
            adding = asyncio.ensure_future(self.cluster.add_generators(count))
            await asyncio.sleep(0)  # add_generators creates its actors before its first await
            new = [rid for rid in self.cluster.generators if rid not in before]
            event.replicas.extend(new)
            if made is not None:
                made.extend(new)
            try:
                await asyncio.wait_for(adding, self.g.scale_up_timeout_s)
            except BaseException as e:  # timed out (no node came), failed to start, or the run ends
                event.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                print(f"pool: adding {new} failed: {event.error}; given up", flush=True)
                self.policy.add_failed(time.monotonic())
                await asyncio.gather(*(discard(self.cluster, rid) for rid in new), return_exceptions=True)
                if isinstance(e, asyncio.CancelledError):
                    raise
                return
        self.policy.add_succeeded()
        event.ready_s = round(time.monotonic() - decided, 3)
        print(f"pool: {new} caught up and active {event.ready_s:.1f} s after the decision", flush=True)
        await first_request(self.cluster.proxy, new, event, decided)

    async def _shrink(self, rid: str, event: ScaleEvent, decided: float, timeout_s: float | None = None,
                      why: str = REMOVED, stop_anyway: bool = False) -> None:  # fmt: skip
        """Drain `rid` in the proxy, then stop it. A failed drain keeps it unless `stop_anyway` (its node is
        going whatever the drain says, and else it would be seen on that node again next round)."""
        try:
            timeout_s = self.g.drain_timeout_s if timeout_s is None else timeout_s
            try:
                drained = await self.cluster.proxy.drain_replica.remote(rid, timeout_s)
            except Exception as e:
                if not stop_anyway:
                    raise
                print(f"pool: draining {rid} failed ({type(e).__name__}: {e}); it stops anyway", flush=True)
                drained = {"drain_s": 0.0}
            # It left routing and nothing is in flight (or the drain timed out): leave the proxy, stop.
            await self.cluster.remove_generator(rid, why)
            event.drained(rid, drained, time.monotonic() - decided)
            print(f"pool: {rid} drained in {drained['drain_s']:.1f} s ({drained.get('in_flight_at_start')} in "
                  f"flight when it began, {drained.get('in_flight_left')} left) and stopped", flush=True)  # fmt: skip
        except Exception as e:
            event.error = f"removing {rid}: {type(e).__name__}: {e}"
            print(f"pool: {event.error}", flush=True)
        finally:
            self._leaving.pop(rid, None)


PoolActor = ray.remote(PoolController)


async def start_pool(cluster) -> object:
    """Start the run's pool controller, pinned to the driver's node; returns its handle."""
    here = ray.get_runtime_context().get_node_id()
    actor = PoolActor.options(
        name=pool_actor_name(cluster.config.run_name),
        namespace=NAMESPACE,
        num_cpus=0,
        # Its process may die (OOM-killed, a crash): Ray restarts it, and it takes the run's generators over
        # (rl_cluster.pool_state.Succession); calls made meanwhile wait for it.
        max_restarts=-1,
        max_task_retries=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
    ).remote(cluster)
    await actor.start.remote()
    return actor
