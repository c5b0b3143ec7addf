"""Prefix-aware routing: which replica most likely holds a prompt's KV-cache blocks.

Pure logic (no HTTP, Ray, vLLM or torch), so it tests in milliseconds. The proxy hashes each prompt into
chained fixed-size blocks, asks `choose_replica` where to send it, then records the blocks for the replica
it chose. The chain is seeded with the requested model name because vLLM keys its prefix cache by adapter:
a prefix computed under `policy-v3` is worthless to a request for `policy-v4`.
"""

from __future__ import annotations

import json
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Literal

from rl_cluster.core.loads import LoadOrder

RouteReason = Literal["affinity", "spill", "unmatched"]
RoutingPolicy = Literal["prefix", "round_robin", "least_loaded"]
_NOBODY: frozenset[str] = frozenset()


def block_hashes(model: str, prompt: str | Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of `prompt` cut into `block_size` tokens (or characters, for text prompts).

    Hash i covers the whole prefix up to the end of block i, so two prompts share hash i exactly when
    they share that prefix (and the model). A trailing partial block is hashed too: vLLM does not cache
    it, but it makes identical prompts (a GRPO group) share one more hash than prompts that only share
    their full blocks, which keeps a group together even when its prompt is shorter than one block.

    The hashes are Python's own (SipHash on bytes and str, salted per process): the table that keeps
    them lives in the same process, and nothing compares them across processes. It is a third of the
    cost of a cryptographic digest per block, which was the largest part of routing a request; a
    collision (2**-64 per pair) would only send a request to a replica without its prefix.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if isinstance(prompt, str):
        # Distinct seeds for text and token prompts, so "12" as text never equals tokens [1, 2].
        previous, payload, width = hash(("t", model)), prompt, 1
    else:
        # Token ids packed once, in C, as little-endian int64 (a Python loop per id cost more than the
        # hashing); block i is then a slice of `width` bytes per token. Packing also checks that every
        # item is an int64: a list of anything else is routed by its canonical JSON text instead.
        try:
            payload = struct.pack(f"<{len(prompt)}q", *prompt)
        except (struct.error, TypeError):
            return block_hashes(model, json.dumps(prompt, sort_keys=True), block_size)
        previous, width = hash(("i", model)), 8
    step = block_size * width
    hashes = []
    for start in range(0, len(payload), step):
        previous = hash((previous, payload[start : start + step]))
        hashes.append(previous)
    return hashes


def request_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """The routing key of an OpenAI-style request body: token ids when it has them, else text.

    Completions take `prompt` as text, token ids, or a batch of either (the first one routes the batch);
    chat completions take `messages`, serialised canonically so equal conversations hash equally.
    """
    prompt = body.get("prompt")
    if prompt is None:
        messages = body.get("messages")
        return "" if messages is None else json.dumps(messages, sort_keys=True, separators=(",", ":"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return prompt  # token ids (block_hashes routes anything else in a list by its JSON)
    return json.dumps(prompt, sort_keys=True)  # something odd: still route it consistently


class PrefixTable:
    """Bounded LRU map: block hash -> ids of the replicas that were sent that block.

    Recording refreshes a block's recency; the least recently recorded blocks fall out first, so memory
    stays at `capacity` entries however many distinct prompts pass through.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._holders: OrderedDict[int, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def holders(self, block_hash: int) -> frozenset[str] | set[str]:
        """Replicas recorded for this block (empty when unknown). Does not refresh recency. Read only."""
        return self._holders.get(block_hash, _NOBODY)

    def record(self, hashes: Iterable[int], replica_id: str) -> None:
        for block_hash in hashes:
            holders = self._holders.get(block_hash)
            if holders is None:
                self._holders[block_hash] = {replica_id}
                if len(self._holders) > self.capacity:
                    self._holders.popitem(last=False)
            else:
                holders.add(replica_id)
                self._holders.move_to_end(block_hash)

    def forget_replica(self, replica_id: str) -> None:
        """Drop a replica from every block (it left, or restarted with an empty cache)."""
        for block_hash in list(self._holders):
            holders = self._holders[block_hash]
            holders.discard(replica_id)
            if not holders:
                del self._holders[block_hash]


@dataclass(frozen=True)
class RouteDecision:
    replica_id: str
    reason: RouteReason
    """affinity: sent where its prefix is; spill: that replica was too busy; unmatched: no useful prefix."""
    matched_blocks: int
    """Prompt-specific blocks the chosen replica was recorded for (0 unless affinity)."""


def specific_matches(hashes: Sequence[int], table: PrefixTable, eligible: Set[str]) -> dict[str, int]:
    """Per eligible replica holding any, how many of the prompt's blocks it holds that not every eligible
    replica holds (replicas with none are left out).

    Blocks every eligible replica holds (a shared system prompt) say nothing about where to go, so they
    count for nothing (unless only one replica is eligible: then a hit is still a hit, for the metrics).
    The walk stops at the first block nobody eligible holds: hashes are chained, so later blocks can
    only match through it. Set intersections and the counting run in C: a block most replicas hold (a
    shared prefix some have not seen yet) has hundreds of holders at scale, and a Python loop over them
    was the proxy's cost growing with N.
    """
    counts: Counter[str] = Counter()
    several = len(eligible) > 1
    for block_hash in hashes:
        held_by = table.holders(block_hash)
        if several and eligible <= held_by:  # (a size comparison first: no pass unless it may be)
            continue
        holders = held_by & eligible
        if not holders:
            break
        counts.update(holders)
    return counts


def route(
    hashes: Sequence[int],
    table: PrefixTable,
    loads: LoadOrder,
    eligible: Set[str],
    imbalance_threshold: int,
    policy: RoutingPolicy = "prefix",
) -> RouteDecision | None:
    """Pick a replica among `eligible` (routable replicas in `loads`); None when there is none.

    The replica with the most prompt-specific matching blocks wins unless its load exceeds the
    least-loaded replica's by more than `imbalance_threshold` (then the least-loaded: a spill). Without any
    match, the least-loaded. Ties go to less load, then fewer requests served so far, then the smaller
    replica id (LoadOrder's order): the same inputs always give the same answer. Loads are relative to
    capacity (rl_cluster.core.loads), so the threshold is a number of requests on the smallest replica,
    and a GRPO group of G <= threshold requests never spills by its own weight. The baselines
    `round_robin` and `least_loaded` ignore prefixes (reason "unmatched").
    """
    least_loaded = loads.least(eligible.__contains__)
    if least_loaded is None:
        return None
    if policy == "least_loaded":
        return RouteDecision(least_loaded, "unmatched", 0)
    if policy == "round_robin":
        return RouteDecision(loads.fewest_served(eligible.__contains__), "unmatched", 0)
    matches = specific_matches(hashes, table, eligible)
    if not matches:
        return RouteDecision(least_loaded, "unmatched", 0)
    top = max(matches.values())
    leaders = [replica_id for replica_id, count in matches.items() if count == top]
    best = min(leaders, key=loads.key)
    if loads.load(best) - loads.load(least_loaded) > imbalance_threshold:
        return RouteDecision(least_loaded, "spill", 0)
    return RouteDecision(best, "affinity", matches[best])


def choose_replica(
    hashes: Sequence[int],
    table: PrefixTable,
    in_flight: Mapping[str, int],
    imbalance_threshold: int,
    served: Mapping[str, int] | None = None,
    policy: RoutingPolicy = "prefix",
    capacity: Mapping[str, int | None] | None = None,
) -> RouteDecision:
    """`route` among the keys of `in_flight` (the eligible replicas, with their in-flight counts), from
    plain counts: `served` (requests so far) and `capacity` per replica. Builds the load order each call
    (a pass over all replicas): for simulations and tests; the proxy keeps one LoadOrder."""
    if not in_flight:
        raise ValueError("no eligible replica")
    loads = LoadOrder()
    for replica_id, count in in_flight.items():
        loads.add(replica_id, served=(served or {}).get(replica_id, 0), in_flight=count)
        loads.set_capacity(replica_id, (capacity or {}).get(replica_id))
        loads.set_routable(replica_id, True)
    return route(hashes, table, loads, set(in_flight), imbalance_threshold, policy)
