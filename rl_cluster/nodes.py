"""Where the calling Ray process runs: what every actor reports for summary.json's `placement`.

Its own module, below the actors: cluster.py creates the actors, so they cannot import it back.
"""

from __future__ import annotations

import ray


def node_placement() -> dict:
    """The calling process's node: its address and id."""
    return {"address": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id()}
