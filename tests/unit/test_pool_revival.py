"""The pool controller's look after its generators: a restarted actor is started again, one whose
restart budget is spent is stopped (so the policy can replace it). The cluster is an in-memory stand-in
with the two calls the controller makes; the real path runs in the chaos run of tests/e2e/test_multinode.py."""

from __future__ import annotations

import asyncio

from rl_cluster.config import load_config
from rl_cluster.core.scaling import ScaleEvent
from rl_cluster.pool import PoolController
from rl_cluster.pool_state import RecordKeeper


class Cluster:
    def __init__(self, restarted: list[str], spent: list[str], revive_fails: bool = False):
        self.config = load_config(None, ["run_name=pool-test", "generator.replicas=3"])
        self.generators = {"g0": object(), "g1": object(), "g2": object()}
        self.restarted, self.spent, self.revive_fails = restarted, spent, revive_fails
        self.revived: list[str] = []
        self.removed: list[str] = []

    async def generators_to_mend(self) -> dict[str, str]:
        return {**dict.fromkeys(self.restarted, "restarted"), **dict.fromkeys(self.spent, "spent")}

    async def revive(self, rid: str) -> None:
        if self.revive_fails:
            raise RuntimeError("vLLM did not start")
        self.revived.append(rid)

    async def remove_generator(self, rid: str) -> None:
        self.generators.pop(rid)
        self.removed.append(rid)


async def settle(pool: PoolController) -> None:
    await pool._mend()
    await asyncio.gather(*pool._tasks)


async def test_a_restarted_generator_is_started_again_and_a_spent_one_leaves():
    cluster = Cluster(restarted=["g0"], spent=["g2"])
    pool = PoolController(cluster, RecordKeeper.in_memory())
    await settle(pool)
    assert cluster.revived == ["g0"]
    assert cluster.removed == ["g2"] and set(cluster.generators) == {"g0", "g1"}
    assert not pool._leaving  # done leaving: the policy now sees a pool of two


async def test_a_generator_that_fails_to_start_again_is_discarded():
    cluster = Cluster(restarted=["g1"], spent=[], revive_fails=True)
    pool = PoolController(cluster, RecordKeeper.in_memory())
    await settle(pool)
    assert cluster.revived == [] and cluster.removed == ["g1"] and set(cluster.generators) == {"g0", "g2"}


class Remote:
    """`actor.method.remote(...)` of a stand-in actor: a coroutine."""

    def __init__(self, fn):
        self.remote = fn


class DrainingCluster:
    """g0 and g1 serving on two nodes; Ray drains g0's. The replacement starts when asked to."""

    def __init__(self):
        from rl_cluster.core.replica_history import ReplicaHistory

        self.config = load_config(None, ["run_name=pool-test", "generator.replicas=2"])
        self.generators = {"g0": object(), "g1": object()}
        self.restarts_seen, self._slots, self._next_index = {}, {"g0": 0, "g1": 1}, 2  # what the pool keeps
        self.history = ReplicaHistory()
        self.history.placed("g0", {"address": "10.0.0.3", "node_id": "n3"})
        self.history.placed("g1", {"address": "10.0.0.4", "node_id": "n4"})
        self.placement, self.proxy_movable = {"proxy": {"address": "10.0.0.1", "node_id": "n1"}}, False
        self.started = asyncio.Event()  # lets the replacement start (the test holds it back)
        self.removed: list[str] = []
        self.proxy = type("Proxy", (), {})()
        self.proxy.stats = Remote(self._stats)
        self.proxy.drain_replica = Remote(self._drain)

    async def _stats(self):
        active = {"state": "active", "in_flight": 0, "requests": 5}
        registered = [rid for rid in self.generators if rid != "g2" or self.started.is_set()]
        return {"replicas": {rid: dict(active) for rid in registered}}

    async def _drain(self, rid, timeout_s):
        return {"in_flight_at_start": 0, "in_flight_left": 0, "drain_s": 0.0}

    async def add_generators(self, count):
        self.generators["g2"] = object()  # as the real one: the actor exists at once, its vLLM starts later
        await self.started.wait()
        return ["g2"]

    async def remove_generator(self, rid, why="removed"):
        self.generators.pop(rid)
        self.removed.append(rid)
        self.history.ended(rid, why)


async def test_a_replica_on_a_draining_node_is_replaced_once_and_the_policy_sees_no_hole(monkeypatch):
    import rl_cluster.pool as pool_module

    cluster = DrainingCluster()
    monkeypatch.setattr(pool_module, "draining_nodes", lambda: {"n3": None})
    pool = PoolController(cluster, RecordKeeper.in_memory())
    await pool._evacuate_draining()
    # The same round's step, before the replacement's actor exists (its task has not run yet): g0 is out
    # of the count, and without the replacement counted the policy would add a second ("below min").
    assert await pool.step() is None
    await pool._evacuate_draining()  # the next round: g0 is already on its way out
    assert await pool.step() is None
    cluster.started.set()
    await asyncio.gather(*pool._tasks)
    assert cluster.removed == ["g0"] and set(cluster.generators) == {"g1", "g2"}
    (event,) = pool.events
    assert event.replicas == ["g0", "g2"] and event.reason.startswith("g0 replaced: its node 10.0.0.3")
    assert event.drain["g0"]["in_flight_left"] == 0 and event.ready_s is not None
    (fault,) = cluster.history.fault_list()
    assert (fault["who"], fault["what"]) == ("g0", "node drained (10.0.0.3)") and fault["recovered_s"] >= 0
    assert not pool.replacements.pending and not pool._leaving


class FailingDrainCluster(DrainingCluster):
    """As DrainingCluster, but the proxy does not know g0 (a restarted proxy that lost it): its drain
    fails. Replacements start at once, each with a new id."""

    def __init__(self):
        super().__init__()
        self.started.set()
        self.adds = 0

    async def _drain(self, rid, timeout_s):
        raise KeyError(f"unknown replica {rid!r}")

    async def add_generators(self, count):
        self.adds += 1
        rid = f"g{1 + self.adds}"
        self.generators[rid] = object()
        return [rid]


async def test_a_replica_whose_drain_fails_is_replaced_once_and_stopped_all_the_same(monkeypatch):
    import rl_cluster.pool as pool_module

    cluster = FailingDrainCluster()
    monkeypatch.setattr(pool_module, "draining_nodes", lambda: {"n3": None})
    pool = PoolController(cluster, RecordKeeper.in_memory())
    for _ in range(4):  # four rounds: before, each one whose drain had failed started one more replacement
        await pool._evacuate_draining()
        await asyncio.gather(*pool._tasks)
    assert cluster.adds == 1 and cluster.removed == ["g0"] and set(cluster.generators) == {"g1", "g2"}
    (event,) = pool.events
    assert event.replicas == ["g0", "g2"] and not pool.replacements.pending and not pool._leaving


def test_a_replica_gets_one_replacement_for_the_run_and_none_past_max_replicas():
    from rl_cluster.core.replacement import Replacements

    rules = Replacements(max_replicas=3)
    assert rules.grant("g0", staying=2)
    assert not rules.grant("g0", staying=2)  # seen again on its draining node: it is only stopped
    assert rules.grant("g1", staying=1)  # two nodes drain at once: 1 staying + 1 on its way + 1
    assert not rules.grant("g2", staying=2)  # 2 staying + 2 on their way + 1 would pass max_replicas
    rules.pending["g0"].append("g3")  # g0's replacement's actor exists: the snapshot counts it now
    assert rules.unstarted() == 1
    rules.done("g0")
    rules.done("g1")
    assert rules.grant("g2", staying=2) and rules.replaced == {"g0", "g1", "g2"}


class RestartedProxyCluster(DrainingCluster):
    """g0 and g1 serving; a scale-out waits for a node (its add holds the pool's add lock), and then
    Ray restarts the proxy."""

    def __init__(self):
        super().__init__()
        self.config.generator.scale_interval_s = 0.01
        self.proxy_restarted = False
        self.restored = asyncio.Event()
        self.proxy.awaiting_restore = Remote(self._awaiting_restore)

    async def _awaiting_restore(self):
        return self.proxy_restarted and not self.restored.is_set()

    async def restore_proxy(self):
        self.restored.set()

    async def generators_to_mend(self):
        return {}


async def test_a_restarted_proxy_is_restored_while_a_scale_out_waits_for_a_node(monkeypatch):
    import rl_cluster.pool as pool_module

    cluster = RestartedProxyCluster()
    monkeypatch.setattr(pool_module, "draining_nodes", lambda: {})
    pool = PoolController(cluster, RecordKeeper.in_memory())
    pool._spawn(pool._grow(1, ScaleEvent(0.0, 2, 3, "demand"), 0.0))  # its node never comes (here)
    await asyncio.sleep(0.05)
    assert pool._growing.locked()
    cluster.proxy_restarted = True
    await pool.start()
    try:
        # Before, the restore waited for the add (up to generator.scale_up_timeout_s, 900 s): the
        # proxy's port stayed closed past the trainer's 180 s reconnect window.
        await asyncio.wait_for(cluster.restored.wait(), 2.0)
        assert pool._growing.locked() and pool.proxy_restores == 1
    finally:
        cluster.started.set()  # the node came: the add ends
        await asyncio.gather(*pool._tasks)
        pool._loop.cancel()


async def test_a_start_asked_twice_runs_one_loop():
    """Ray may deliver a call it retried across the controller's restart twice: two loops would restore a
    restarted proxy twice at once."""
    pool = PoolController(RestartedProxyCluster(), RecordKeeper.in_memory())
    await pool.start()
    loop = pool._loop
    await pool.start()
    assert pool._loop is loop
    loop.cancel()


async def test_a_successor_takes_out_a_replica_its_predecessor_died_taking_out():
    """The record says which replicas were on their way out; a restarted controller drains and stops them
    (a drain is idempotent in the proxy), under the same scale event. Else the proxy keeps such a replica
    out of routing, the policy does not count it, and its server runs for the rest of the run."""
    from rl_cluster.core.replica_history import REMOVED
    from rl_cluster.pool_state import Leaving, finish_leaving

    cluster = DrainingCluster()
    cluster.config = load_config(
        None, ["run_name=pool-test", "generator.replicas=2", "generator.min_replicas=1"]
    )
    keeper = RecordKeeper.in_memory("pool-test")
    pool = PoolController(cluster, keeper)
    pool.policy.set_target(1)
    decision = await pool.step()
    (rid,) = decision.remove
    pool._succession.keep()  # the round's keep, then the controller dies before the shrink ran
    for task in pool._tasks:
        task.cancel()
    record = keeper.recall()
    assert record.leaving == {rid: Leaving(REMOVED, 0)} and cluster.removed == []

    successor = PoolController(cluster, RecordKeeper.in_memory("pool-test"))
    successor.events = record.events
    await finish_leaving(successor, rid, record.leaving[rid])
    assert cluster.removed == [rid] and not successor._leaving
    (event,) = successor.events
    assert event.replicas == [rid] and event.drain[rid]["in_flight_left"] == 0


class ProxyOnNodes:
    """The run's proxy on node n1, placed by the `proxy` resource (or pinned to the driver's node)."""

    def __init__(self, movable: bool = True):
        self.proxy, self.proxy_movable = object(), movable
        self.placement = {"proxy": {"address": "10.0.0.1", "node_id": "n1"}}


async def test_a_proxy_on_a_draining_node_is_restarted_elsewhere_once_and_only_where_it_can_go(monkeypatch):
    """A preemption notice on the proxy's node: Ray restarts the proxy on another `proxy` node before the
    deadline (then the controller restores it, as after a lost node). Asked once per node; never for a
    proxy pinned to the driver's node or when no other live `proxy` node could take it."""
    import rl_cluster.pool as pool_module

    killed, others = [], {"n1": "10.0.0.2"}
    monkeypatch.setattr(pool_module.ray, "kill", lambda actor, no_restart: killed.append((actor, no_restart)))
    monkeypatch.setattr(pool_module, "proxy_node_besides", lambda node, draining: others.get(node))
    monkeypatch.setattr(pool_module, "draining_nodes", lambda: {"n3": None})
    cluster, moved_off = ProxyOnNodes(), set()
    await pool_module.move_proxy_off_draining(cluster, moved_off)
    assert not killed  # another node drains, not the proxy's
    monkeypatch.setattr(pool_module, "draining_nodes", lambda: {"n1": 1e12})
    for _ in range(3):  # every round sees the drain until the restore moves the proxy's placement
        await pool_module.move_proxy_off_draining(cluster, moved_off)
    assert killed == [(cluster.proxy, False)] and moved_off == {"n1"}  # restarted by Ray, not ended
    pinned = ProxyOnNodes(movable=False)
    await pool_module.move_proxy_off_draining(pinned, set())
    others.clear()  # no other `proxy` node: it stays until its node goes
    await pool_module.move_proxy_off_draining(ProxyOnNodes(), set())
    assert len(killed) == 1
