"""The proxy process's garbage collector, tuned for serving (as vLLM's API server tunes its own).

Measured on the capacity benchmark's load (bench/capacity.py: 64 connections, 8 upstreams), CPython's
default collector took about a tenth of the proxy's CPU: every in-flight request keeps a few hundred
container objects alive (coroutines, futures, headers, the parsed body), so a young-generation pass,
which the default threshold of 700 net allocations starts every two or three requests, walks thousands
of live objects each time, and every full pass walks the ~55,000 objects of the imports (pydantic,
aiohttp; Ray's too, in the actor) as well. `freeze_startup_heap` moves what exists after start-up out of the collector's sight
(`gc.freeze`, vLLM's `freeze_gc_heap`) and starts young passes every 10,000 net allocations. Reference
counting still frees everything acyclic at once; cycles wait a little longer, a few MB at most.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000


def freeze_startup_heap() -> None:
    """Call once the server is up: later passes skip everything that exists now. Process-wide."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
