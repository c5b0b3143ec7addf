"""Where replicas ran and the faults they came through (rl_cluster.core.replica_history)."""

from rl_cluster.core.replica_history import ACTOR_DIED, NODE_LOST, REMOVED, ReplicaHistory
from rl_cluster.core.summary import summary_table

A = {"address": "10.0.0.3", "node_id": "n3"}
B = {"address": "10.0.0.5", "node_id": "n5"}


def test_a_replica_moved_by_a_lost_node_has_two_stints_and_one_fault_with_its_recovery():
    h = ReplicaHistory()
    h.placed("g1", A, now=100.0)
    h.observe("g1", serving=True, now=102.0)
    h.observe("g1", serving=False, now=130.0)  # the pool sees it out of routing first
    h.observe("g1", serving=False, now=132.0)
    h.cause("g1", f"{NODE_LOST} (10.0.0.3)", opens=True, now=150.0)  # the revive learns why
    h.ended("g1", f"{NODE_LOST} (10.0.0.3)", now=150.0)
    h.placed("g1", B, now=190.0)
    h.observe("g1", serving=False, now=190.0)  # catching up
    h.observe("g1", serving=True, now=194.0)

    assert h.placement_history() == {
        "g1": [
            {"address": "10.0.0.3", "node_id": "n3", "from": 100.0, "until": 150.0,
             "ended_by": "node lost (10.0.0.3)"},
            {"address": "10.0.0.5", "node_id": "n5", "from": 190.0, "until": None, "ended_by": None},
        ]
    }  # fmt: skip
    assert h.fault_list() == [
        {"time": 130.0, "what": "node lost (10.0.0.3)", "who": "g1", "recovered_s": 64.0}
    ]


def test_a_replica_that_never_served_has_no_fault_and_one_that_never_comes_back_keeps_it_open():
    h = ReplicaHistory()
    h.placed("g0", A, now=0.0)
    h.observe("g0", serving=False, now=1.0)  # starting: not a fault
    h.cause("g0", ACTOR_DIED, opens=True, now=2.0)
    assert h.fault_list() == []
    h.observe("g0", serving=True, now=3.0)
    h.observe("g0", serving=False, now=9.0)
    h.ended("g0", REMOVED, now=10.0)
    h.forget("g0")
    assert h.fault_list() == [{"time": 9.0, "what": "out of routing", "who": "g0", "recovered_s": None}]
    assert h.placement_history()["g0"][0]["ended_by"] == REMOVED


def test_a_restart_faster_than_a_round_is_opened_by_the_revive_and_a_late_cause_names_the_last_fault():
    h = ReplicaHistory()
    h.placed("g0", A, now=0.0)
    h.observe("g0", serving=True, now=1.0)
    h.cause("g0", ACTOR_DIED, opens=True, now=5.0)  # never seen out: the revive opens it
    h.observe("g0", serving=True, now=40.0)
    # An engine restart the pool saw out and back before it read the restart count: the count names it.
    h.observe("g0", serving=False, now=50.0)
    h.observe("g0", serving=True, now=60.0)
    h.cause("g0", "vLLM server restarted", now=65.0)
    h.cause("g0", "named twice", now=66.0)  # a named fault keeps its name, and is over: a new one opens
    h.observe("g0", serving=True, now=70.0)
    assert [(f["what"], f["recovered_s"]) for f in h.fault_list()] == [
        (ACTOR_DIED, 35.0),
        ("vLLM server restarted", 10.0),
        ("named twice", 4.0),
    ]


def test_a_cause_learnt_before_the_pool_saw_the_replica_out_names_the_fault_it_opens():
    # CI's chaos run: the pool read g0's restart count before its round saw g0 out of routing, and the
    # engine kill was recorded as "out of routing (vLLM server exited with code 0)", with no cause.
    h = ReplicaHistory()
    h.observe("g0", serving=True, now=1.0)
    h.cause("g0", "vLLM server restarted (vLLM server exited with code 0)", now=10.0)
    h.observe("g0", serving=False, why="vLLM server exited with code 0", now=12.0)
    h.observe("g0", serving=True, now=38.0)
    # An unnamed fault long over is not named by a cause learnt much later: that is a fault of its own.
    h.observe("g0", serving=False, why="health check failed: timeout", now=100.0)
    h.observe("g0", serving=True, now=110.0)
    h.cause("g0", "vLLM server restarted (vLLM server failed /health 3 times in a row)", now=500.0)
    h.observe("g0", serving=True, now=505.0)
    assert [(f["time"], f["what"], f["recovered_s"]) for f in h.fault_list()] == [
        (10.0, "vLLM server restarted (vLLM server exited with code 0)", 28.0),
        (100.0, "out of routing (health check failed: timeout)", 10.0),
        (500.0, "vLLM server restarted (vLLM server failed /health 3 times in a row)", 5.0),
    ]


def test_the_table_names_each_fault_and_where_a_moved_replica_was_before():
    h = ReplicaHistory()
    h.placed("g1", A, now=0.0)
    h.observe("g1", serving=True, now=1.0)
    h.cause("g1", f"{NODE_LOST} (10.0.0.3)", opens=True, now=2.0)
    h.placed("g1", B, now=30.0)
    h.observe("g1", serving=True, now=42.0)
    h.record("proxy", "proxy restarted by Ray", 50.0, 7.5)
    summary = {
        "status": "finished", "steps": 1, "wall_time_s": 1.0, "reward_first_fifth": None,
        "reward_last_fifth": None, "versions_published": [], "served_vs_trained_gap": None,
        "handoff_s_p50": None, "handoff_s_max": None, "dropped_stale_samples": 0, "mean_staleness": None,
        "requests": {}, "placement": {"generator g1": B}, "placement_history": h.placement_history(),
        "faults": h.fault_list(),
    }  # fmt: skip
    rows = [" ".join(line.split()) for line in summary_table(summary).splitlines()]
    assert "fault, g1 node lost (10.0.0.3); serving again after 40 s" in rows
    assert "fault, proxy proxy restarted by Ray; serving again after 8 s" in rows
    assert "generator g1 on 10.0.0.5 (before: 10.0.0.3)" in rows


def test_the_proxys_reason_names_a_fault_until_someone_who_knows_more_does():
    h = ReplicaHistory()
    h.observe("g0", serving=True, now=1.0)
    h.observe(
        "g0", serving=False, why="health check failed: timeout", now=5.0
    )  # a link cut: nobody knows more
    h.observe("g0", serving=True, now=40.0)
    h.observe("g1", serving=True, now=1.0)
    h.observe("g1", serving=False, why="health check failed: timeout", now=5.0)
    h.cause("g1", "vLLM server restarted (vLLM server failed /health 3 times in a row)")
    h.observe("g1", serving=False, why="its server was restarted", now=9.0)  # the cause stays
    h.observe("g1", serving=True, now=50.0)
    assert [(f["who"], f["what"], f["recovered_s"]) for f in h.fault_list()] == [
        ("g0", "out of routing (health check failed: timeout)", 35.0),
        ("g1", "vLLM server restarted (vLLM server failed /health 3 times in a row)", 45.0),
    ]
