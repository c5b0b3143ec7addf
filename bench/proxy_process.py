"""Our proxy (rl_cluster.proxy.server.ProxyServer) in a process of its own, in front of given replicas.

In production the proxy is a Ray actor with its own process and event loop; running it inside the
benchmark's load generator would make the two share one Python thread, which no deployment does.

    python -m bench.proxy_process r0=http://127.0.0.1:8001 [r1=...] [--policy round_robin]
"""

from __future__ import annotations

import argparse
import asyncio
import json

from rl_cluster.config import ProxyConfig
from rl_cluster.proxy.server import ProxyServer


def routing_policies() -> list[str]:
    """The proxy's routing policies in this build: `prefix` always; round_robin and least_loaded once
    ProxyConfig has a `routing_policy` field."""
    field = ProxyConfig.model_fields.get("routing_policy")
    if field is None:
        return ["prefix"]
    return list(getattr(field.annotation, "__args__", ("prefix",)))


def proxy_config(policy: str | None) -> ProxyConfig:
    if policy is None or policy == "prefix" and "routing_policy" not in ProxyConfig.model_fields:
        return ProxyConfig()
    if "routing_policy" not in ProxyConfig.model_fields:
        raise SystemExit(f"ProxyConfig has no routing_policy field in this build: cannot route {policy!r}")
    return ProxyConfig(routing_policy=policy)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("replicas", nargs="+", help="id=url")
    parser.add_argument("--policy", default=None)
    args = parser.parse_args()
    proxy = ProxyServer(proxy_config(args.policy))
    url = await proxy.start()
    for spec in args.replicas:
        replica_id, replica_url = spec.split("=", 1)
        await proxy.add_replica(replica_id, replica_url)
    print(json.dumps(url), flush=True)
    try:
        await asyncio.Event().wait()  # until the benchmark terminates this process
    finally:
        await proxy.stop()


if __name__ == "__main__":
    asyncio.run(main())
