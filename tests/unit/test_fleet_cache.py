"""The stub fleet's model of vLLM's prefix cache (bench.fleet): what the scale benchmark's hit rates rest on."""

from __future__ import annotations

from bench.fleet import PrefixCacheModel


def test_only_leading_full_blocks_already_held_are_hits():
    cache = PrefixCacheModel(capacity=100, block_tokens=4)
    prompt = list(range(10))  # two full blocks and a partial one (never cached)
    assert cache.lookup("v1", prompt) == 0
    assert cache.lookup("v1", prompt) == 8
    assert cache.lookup("v1", list(range(8)) + [99, 98, 97, 96]) == 8  # the third block differs
    assert cache.lookup("v1", [5] + list(range(1, 10))) == 0  # a change in block 0 changes every hash
    assert (cache.queries, cache.hits) == (10 + 10 + 12 + 10, 16)


def test_blocks_are_keyed_by_the_adapter_and_the_oldest_fall_out():
    cache = PrefixCacheModel(capacity=2, block_tokens=4)
    cache.lookup("v1", list(range(8)))
    assert cache.lookup("v2", list(range(8))) == 0  # another adapter's KV is another KV
    assert cache.lookup("v1", list(range(8))) == 0  # v2's two blocks pushed v1's out
