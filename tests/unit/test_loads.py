"""LoadOrder: the routable replicas kept in load order as requests begin and end (pure, milliseconds)."""

from __future__ import annotations

import random

import pytest

from rl_cluster.core.loads import LoadOrder


def reference_least(in_flight: dict, served: dict, capacity: dict, routable: set, accept) -> str | None:
    """The least-loaded accepted routable replica from the counts, with one pass over them all (what the
    proxy did per request before LoadOrder)."""
    known = [c for c in capacity.values() if c is not None and c >= 1]
    smallest = min(known, default=1)

    def relative(count: int, replica_id: str) -> float:
        size = capacity.get(replica_id)
        return count * smallest / (size if size is not None and size >= 1 else smallest)

    keys = {r: (relative(in_flight[r], r), relative(served[r], r), r) for r in routable if accept(r)}
    return min(keys, key=keys.__getitem__) if keys else None


def test_the_order_follows_requests_and_ties_go_to_fewer_served_then_the_id():
    loads = LoadOrder()
    for replica_id in ("r1", "r0", "r2"):
        loads.add(replica_id)
        loads.set_routable(replica_id, True)
    assert loads.least(lambda r: True) == "r0"  # all idle and unserved: the smallest id
    loads.begin("r0")
    assert loads.least(lambda r: True) == "r1"
    loads.end("r0")  # idle again, but served one: the others first
    assert loads.least(lambda r: True) == "r1" and loads.served("r0") == 1 and loads.in_flight("r0") == 0
    assert loads.least(lambda r: r == "r0") == "r0" and loads.least(lambda r: False) is None
    with pytest.raises(ValueError, match="no request in flight"):
        loads.end("r0")


def test_a_replica_out_of_routing_keeps_its_counts_and_comes_back_in_place():
    loads = LoadOrder()
    for replica_id in ("r0", "r1"):
        loads.add(replica_id)
        loads.set_routable(replica_id, True)
    loads.begin("r0")
    loads.set_routable("r0", False)  # unhealthy, or draining: its request still runs
    assert "r0" not in loads and len(loads) == 1 and loads.in_flight("r0") == 1
    loads.end("r0")
    loads.set_routable("r0", True)
    assert loads.key("r0") == (0, 1, "r0") and loads.least(lambda r: True) == "r1"
    loads.remove("r0")
    assert set(loads.routable_ids()) == {"r1"} and loads.served("r0") == 0


def test_capacities_scale_loads_to_the_smallest_replica():
    loads = LoadOrder()
    for replica_id in ("big", "small", "unknown"):
        loads.add(replica_id)
        loads.set_routable(replica_id, True)
    loads.set_capacity("big", 64)
    loads.set_capacity("small", 32)
    for _ in range(4):
        loads.begin("big")
    assert loads.smallest == 32 and loads.load("big") == 2.0  # 4 on a replica twice as large
    assert loads.load("unknown") == 0 and loads.key("unknown")[0] == 0
    for _ in range(3):
        loads.begin("small")
        loads.begin("unknown")  # counts as the smallest known one
    assert loads.least(lambda r: True) == "big"
    loads.remove("small")  # the smallest leaves: every key is rescaled
    assert loads.smallest == 64 and loads.load("big") == 4 and loads.load("unknown") == 3


def test_the_least_loaded_is_what_a_pass_over_all_replicas_finds():
    rng = random.Random(7)
    loads = LoadOrder()
    replicas = [f"r{i:02d}" for i in range(24)]
    in_flight, served, capacity, routable = {}, {}, {}, set()
    for replica_id in replicas:
        loads.add(replica_id)
        in_flight[replica_id] = served[replica_id] = 0
    for step in range(20_000):
        replica_id = rng.choice(replicas)
        action = rng.random()
        if action < 0.45:
            loads.begin(replica_id)
            in_flight[replica_id] += 1
            served[replica_id] += 1
        elif action < 0.9 and in_flight[replica_id]:
            loads.end(replica_id)
            in_flight[replica_id] -= 1
        elif action < 0.95:
            if rng.random() < 0.8:
                loads.set_routable(replica_id, True)
                routable.add(replica_id)
            else:
                loads.set_routable(replica_id, False)
                routable.discard(replica_id)
        elif action < 0.97:
            capacity[replica_id] = rng.choice([None, 0, 16, 32, 48, 256])
            loads.set_capacity(replica_id, capacity[replica_id])
        tried = set(rng.sample(replicas, 3))
        accept = lambda r, tried=tried: r not in tried  # noqa: E731
        assert loads.least(accept) == reference_least(in_flight, served, capacity, routable, accept), step
