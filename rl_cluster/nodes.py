"""Where the calling Ray process runs, and the ports its restartable servers take there.

Its own module, below the actors: cluster.py creates the actors, so they cannot import it back.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

import ray

# Ray's worker processes take ports 10002..19999 by default (`ray start --min-worker-port/--max-worker-port`).
STABLE_PORTS_FROM = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def node_placement() -> dict:
    """The calling process's node: its address and id."""
    return {"address": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id()}


def stable_port(host: str, tries: int = 100) -> int:
    """A free port of `host` for a server that is restarted on the same port (the proxy, a vLLM server):
    below the kernel's ephemeral range, where no outgoing connection is ever given it as its own. Inside
    that range, while the server is down, any connection on the node may be given its port (a client that
    keeps retrying that very port even connects to itself: TCP's simultaneous open), and the restarted
    server cannot bind it until that connection ends. Falls back to any free port where the range is
    unknown (not Linux) or nothing below it is free."""
    low = _ephemeral_low()
    for _ in range(tries if low > STABLE_PORTS_FROM else 0):
        port = random.randrange(STABLE_PORTS_FROM, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
