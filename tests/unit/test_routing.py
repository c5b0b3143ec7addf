"""Prefix-aware routing rules (pure, milliseconds)."""

from __future__ import annotations

import time

import pytest

from rl_cluster.core.routing import (
    PrefixTable,
    block_hashes,
    choose_replica,
    request_prompt,
    specific_matches,
)

REPLICAS = ("r0", "r1", "r2")


def route(table: PrefixTable, hashes: list[int], in_flight: dict[str, int], threshold: int = 4, served=None):
    """Route one request the way the proxy does: choose, then record the blocks for the chosen replica."""
    decision = choose_replica(hashes, table, in_flight, threshold, served)
    table.record(hashes, decision.replica_id)
    return decision


def test_hashes_are_chained_prefixes():
    a = block_hashes("m", list(range(40)), 16)
    b = block_hashes("m", list(range(32)) + [99] * 8, 16)
    assert len(a) == 3  # two full blocks and the trailing partial one
    assert a[:2] == b[:2] and a[2] != b[2]
    # A change in the first block changes every later hash: block i stands for the whole prefix.
    c = block_hashes("m", [7] + list(range(1, 40)), 16)
    assert all(x != y for x, y in zip(a, c, strict=True))


def test_text_and_token_prompts_never_collide():
    assert block_hashes("m", "12", 16) != block_hashes("m", [1, 2], 16)
    assert block_hashes("m", "", 16) == []


def test_a_list_that_is_not_token_ids_still_routes_consistently():
    odd = [1.5, "x", None, [2]] * 10  # valid JSON a client may send; vLLM will refuse it, the proxy routes it
    assert block_hashes("m", odd, 16) == block_hashes("m", list(odd), 16)
    assert block_hashes("m", odd, 16) != block_hashes("m", odd[:-1] + [[3]], 16)
    assert block_hashes("m", [2**63], 16) == block_hashes("m", [2**63], 16)  # beyond int64: no crash


def test_adapter_versions_never_share_prefix_entries():
    prompt = list(range(64))
    v3, v4 = block_hashes("policy-v3", prompt, 16), block_hashes("policy-v4", prompt, 16)
    assert not set(v3) & set(v4)
    table = PrefixTable(100)
    table.record(v3, "r0")
    decision = choose_replica(v4, table, {"r0": 0, "r1": 0}, 4)
    assert decision.reason == "unmatched"


def test_group_of_identical_prompts_lands_on_one_replica():
    table = PrefixTable(1000)
    in_flight = dict.fromkeys(REPLICAS, 0)
    # Some unrelated traffic first, so the replicas are not all idle and empty.
    for i in range(6):
        r = route(table, block_hashes("v1", f"other prompt {i} " * 5, 16), in_flight).replica_id
        in_flight[r] += 1
    group = block_hashes("v1", "What is 12 + 30? Think step by step.", 16)
    chosen = []
    for _ in range(8):  # a GRPO group, sent at once: in-flight grows with each one
        decision = route(table, group, in_flight, threshold=8)
        in_flight[decision.replica_id] += 1
        chosen.append(decision)
    assert len({d.replica_id for d in chosen}) == 1
    assert [d.reason for d in chosen] == ["unmatched"] + ["affinity"] * 7


def test_short_prompt_group_still_sticks():
    table = PrefixTable(100)
    in_flight = {"r0": 0, "r1": 0}
    hashes = block_hashes("base", "1+2=", 16)  # shorter than one block
    first = route(table, hashes, in_flight)
    in_flight[first.replica_id] += 1
    assert route(table, hashes, in_flight).replica_id == first.replica_id


def test_imbalance_guard_spills_to_least_loaded():
    table = PrefixTable(100)
    hashes = block_hashes("v1", "a long shared prompt " * 4, 16)
    table.record(hashes, "r0")
    assert choose_replica(hashes, table, {"r0": 6, "r1": 2}, 4).reason == "affinity"  # 6 - 2 = 4: not over
    decision = choose_replica(hashes, table, {"r0": 7, "r1": 2}, 4)
    assert (decision.replica_id, decision.reason) == ("r1", "spill")


def test_shared_system_prompt_counts_for_nothing():
    system = "You are a careful assistant. Answer briefly. " * 3
    table = PrefixTable(1000)
    # Earlier traffic put the system prompt on both replicas; r1 also saw more of it.
    table.record(block_hashes("v1", system + "question one", 16), "r0")
    table.record(block_hashes("v1", system + "question two", 16), "r1")
    table.record(block_hashes("v1", system + "question three", 16), "r1")
    new = block_hashes("v1", system + "a brand new question", 16)
    assert specific_matches(new, table, {"r0", "r1"}) == {}  # nobody holds a specific block
    # r1 is busier: without a specific match the least-loaded replica wins.
    assert choose_replica(new, table, {"r0": 1, "r1": 0}, 4).replica_id == "r1"
    assert choose_replica(new, table, {"r0": 0, "r1": 1}, 4).reason == "unmatched"


def test_more_specific_blocks_win():
    table = PrefixTable(1000)
    long_prompt = "x" * 64
    table.record(block_hashes("m", long_prompt[:32], 16), "r0")
    table.record(block_hashes("m", long_prompt, 16), "r1")
    decision = choose_replica(block_hashes("m", long_prompt + "y", 16), table, {"r0": 0, "r1": 0}, 4)
    assert (decision.replica_id, decision.reason) == ("r1", "affinity")


def test_ties_are_deterministic():
    table = PrefixTable(10)
    hashes = block_hashes("m", "p", 16)
    assert choose_replica(hashes, table, {"r1": 0, "r0": 0}, 4).replica_id == "r0"
    # Fewer requests served breaks an in-flight tie, so sequential traffic alternates.
    assert choose_replica(hashes, table, {"r1": 0, "r0": 0}, 4, served={"r0": 3, "r1": 2}).replica_id == "r1"
    with pytest.raises(ValueError):
        choose_replica(hashes, table, {}, 4)


def test_single_eligible_replica_hit_counts_as_affinity():
    table = PrefixTable(10)
    hashes = block_hashes("m", "prompt", 16)
    table.record(hashes, "r0")
    assert choose_replica(hashes, table, {"r0": 0}, 4).reason == "affinity"


def test_forget_replica():
    table = PrefixTable(10)
    hashes = block_hashes("m", "x" * 40, 16)
    table.record(hashes, "r0")
    table.record(hashes, "r1")
    table.forget_replica("r0")
    assert all(table.holders(h) == {"r1"} for h in hashes)
    table.forget_replica("r1")
    assert len(table) == 0


def test_memory_is_bounded():
    capacity = 10_000
    table = PrefixTable(capacity)
    start = time.monotonic()
    for i in range(1_000_000):  # one-block prompts: the cost is the table, not the hashing
        table.record((i,), "r0")
    assert len(table) == capacity
    assert table.holders(999_999) == {"r0"} and table.holders(0) == set()  # the oldest fell out
    assert time.monotonic() - start < 10
    # Hashed one-block prompts too, fewer of them.
    for i in range(20_000):
        table.record(block_hashes("m", str(i), 16), "r1")
    assert len(table) == capacity


def test_recording_refreshes_recency():
    table = PrefixTable(2)
    table.record([1], "r0")
    table.record([2], "r0")
    table.record([1], "r1")  # 1 is now the most recent
    table.record([3], "r0")
    assert table.holders(1) == {"r0", "r1"} and table.holders(2) == set()


def test_request_prompt():
    assert request_prompt({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert request_prompt({"prompt": "hi"}) == "hi"
    assert request_prompt({"prompt": [[4, 5], [6]]}) == [4, 5]
    assert request_prompt({"prompt": ["a", "b"]}) == "a"
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert request_prompt(chat) == request_prompt({"messages": [{"content": "hi", "role": "user"}]})
    assert request_prompt({}) == ""


def test_baseline_policies_ignore_prefixes():
    table = PrefixTable(capacity=100)
    hashes = block_hashes("m", list(range(64)), 16)
    table.record(hashes, "r0")
    in_flight = {"r0": 0, "r1": 1}
    served = {"r0": 5, "r1": 2}
    assert choose_replica(hashes, table, in_flight, 8, served).replica_id == "r0"  # prefix: affinity
    assert choose_replica(hashes, table, in_flight, 8, served, policy="round_robin").replica_id == "r1"
    assert choose_replica(hashes, table, in_flight, 8, served, policy="least_loaded").replica_id == "r0"
    assert (
        choose_replica(hashes, table, {"r0": 3, "r1": 1}, 8, served, policy="least_loaded").replica_id == "r1"
    )


def simulate(capacity, requests: int, concurrency: int, policy="prefix", prompts=None):
    """Closed loop: `concurrency` requests in flight, the oldest finishes before each new one is routed
    (all take equally long), distinct prompts unless `prompts` says otherwise. Returns the requests per
    replica and the replica of each request."""
    table = PrefixTable(100_000)
    in_flight = dict.fromkeys(capacity, 0)
    served = dict.fromkeys(capacity, 0)
    running: list[str] = []
    chosen: list[str] = []
    for i in range(requests):
        if len(running) == concurrency:
            in_flight[running.pop(0)] -= 1
        prompt = prompts(i) if prompts else f"{i} is a prompt of its own"
        hashes = block_hashes("v1", prompt, 16)
        decision = choose_replica(hashes, table, in_flight, 8, served, policy, capacity=capacity)
        table.record(hashes, decision.replica_id)
        in_flight[decision.replica_id] += 1
        served[decision.replica_id] += 1
        running.append(decision.replica_id)
        chosen.append(decision.replica_id)
    return served, chosen


@pytest.mark.parametrize("policy", ["prefix", "least_loaded", "round_robin"])
@pytest.mark.parametrize("concurrency", [1, 12, 48])
def test_replica_twice_as_large_takes_twice_the_traffic(policy, concurrency):
    served, _ = simulate({"big": 256, "small": 128}, requests=3000, concurrency=concurrency, policy=policy)
    assert served["big"] / served["small"] == pytest.approx(2.0, rel=0.02), served


def test_grpo_groups_share_by_capacity_and_stay_together():
    # Groups of 8 identical prompts, 12 groups in flight: whole groups go where the load is lowest
    # relative to capacity, so the larger replica gets about twice the groups (whole groups: the share
    # moves in steps of one group, hence the looser bound).
    served, chosen = simulate(
        {"big": 64, "small": 32}, requests=8 * 900, concurrency=96, prompts=lambda i: f"group {i // 8}"
    )
    assert served["big"] / served["small"] == pytest.approx(2.0, rel=0.1), served
    assert all(len(set(chosen[g : g + 8])) == 1 for g in range(0, len(chosen), 8))


def test_imbalance_guard_compares_load_relative_to_capacity():
    table = PrefixTable(100)
    hashes = block_hashes("v1", "a long shared prompt " * 4, 16)
    table.record(hashes, "big")
    # 16 in flight on a replica twice as large is a load of 8 against 4 on the small one: within 8.
    decision = choose_replica(hashes, table, {"big": 16, "small": 4}, 8, capacity={"big": 2, "small": 1})
    assert decision.reason == "affinity"
    # Equal sizes: 16 against 4 is over the threshold.
    assert choose_replica(hashes, table, {"big": 16, "small": 4}, 8).reason == "spill"
    # Unknown capacity counts as the smallest known one.
    assert choose_replica(hashes, table, {"big": 16, "small": 4}, 8, capacity={"small": 1}).reason == "spill"


def test_equal_capacities_route_exactly_as_without():
    import random

    rng = random.Random(3)
    table_a, table_b = PrefixTable(1000), PrefixTable(1000)
    in_flight = {"r0": 0, "r1": 0, "r2": 0}
    served = dict.fromkeys(in_flight, 0)
    for _ in range(2000):
        for r in in_flight:  # random finishes
            if in_flight[r] and rng.random() < 0.3:
                in_flight[r] -= 1
        hashes = block_hashes("v1", f"group {rng.randrange(40)}", 16)
        plain = choose_replica(hashes, table_a, in_flight, 8, served)
        sized = choose_replica(hashes, table_b, in_flight, 8, served, capacity=dict.fromkeys(in_flight, 256))
        assert plain == sized
        table_a.record(hashes, plain.replica_id)
        table_b.record(hashes, sized.replica_id)
        in_flight[plain.replica_id] += 1
        served[plain.replica_id] += 1
