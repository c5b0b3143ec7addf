"""What a restarted pool controller takes over: a run's generators, found by name (never another run's), and
its predecessor's record."""

from __future__ import annotations

from rl_cluster.core.names import generator_actor_name, replica_number, replica_of


def test_a_generator_name_gives_back_its_replica_and_only_for_its_own_run():
    assert replica_of("run", generator_actor_name("run", "g12")) == "g12"
    assert replica_number("g12") == 12
    # Another run whose name starts like this one's, and the run's other actors, are not its generators.
    assert replica_of("run", generator_actor_name("run-generator-x", "g0")) is None
    assert replica_of("run-generator-x", generator_actor_name("run", "g0")) is None
    assert replica_of("run", "run-pool") is None and replica_of("run", "run-proxy") is None
    assert replica_of("run", "run-generator-") is None


def test_the_pool_record_survives_its_controller():
    """What a successor reads back is what its predecessor kept (in a unit test, in this process)."""
    from rl_cluster.core.replacement import Replacements
    from rl_cluster.core.replica_history import ReplicaHistory
    from rl_cluster.core.scaling import ScaleEvent, ScalingPolicy, ScalingRules
    from rl_cluster.pool_state import PoolRecord, RecordKeeper

    keeper = RecordKeeper.in_memory("run")
    assert keeper.recall() is None
    policy = ScalingPolicy(ScalingRules(1, 3, 4.0, 10.0, 60.0, 30.0))
    policy.set_target(2)
    history = ReplicaHistory()
    history.placed("g0", {"address": "10.0.0.3", "node_id": "n3"})
    record = PoolRecord(policy, Replacements(3), history, [ScaleEvent(1.0, 1, 2, "manual: target 2")],
                        {"g0": 1}, {"g0": 0, "g1": 1}, 2, proxy_restores=1)  # fmt: skip
    keeper.keep(record)
    back = keeper.recall()
    assert back.policy.manual_target == 2 and back.events[0].reason == "manual: target 2"
    assert back.history.current("g0").address == "10.0.0.3" and back.next_index == 2
    assert (back.proxy_restores, back.restarts, back.kept_at) == (1, 0, record.kept_at)
    keeper.forget_run()
    assert keeper.recall() is None
