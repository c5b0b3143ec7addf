"""The ports of servers that are restarted on the same port (the proxy, a vLLM server)."""

from __future__ import annotations


def test_a_restartable_server_gets_a_free_port_below_the_ephemeral_range():
    """A port no client connection is ever given: a proxy or vLLM server restarted on it can bind it."""
    import socket

    from rl_cluster.nodes import STABLE_PORTS_FROM, _ephemeral_low, stable_port

    low = _ephemeral_low()
    ports = {stable_port("127.0.0.1") for _ in range(5)}
    assert all(STABLE_PORTS_FROM <= p < low for p in ports), (ports, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free
