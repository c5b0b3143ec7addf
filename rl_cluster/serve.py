"""`rl-cluster serve` (`jobs/serve.py`): the generators behind the proxy, with the pool controller and no
trainer, until SIGINT or SIGTERM. For evaluation, for clients of a trained run's adapters, and for trying
the pool's scaling by hand."""

from __future__ import annotations

import asyncio
import os

from rl_cluster.config import RunConfig
from rl_cluster.credentials import RunSecrets, proxy_binds_loopback, write_private_file
from rl_cluster.run import log_dir_for, on_signals


async def serve(config: RunConfig) -> None:
    """The generators behind the proxy until SIGINT or SIGTERM; then every process it started stops."""
    import ray

    from rl_cluster.cluster import launch
    from rl_cluster.connection import connect
    from rl_cluster.pool import start_pool

    stop = asyncio.Event()
    loopback, dashboard = connect(config)
    on_signals(stop.set)
    # A proxy others can reach always needs a token (every route but /health, /metrics); a generated one is
    # written to a file. On loopback it may stay open to this machine.
    secrets = RunSecrets.for_run(config, generate_token=not proxy_binds_loopback(config, loopback))
    try:
        # A signal during the ~30 s start cancels it; launch() shuts down what it started when cancelled.
        launching = asyncio.create_task(launch(config, log_dir_for(config), secrets, loopback=loopback))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({launching, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not launching.done():
            launching.cancel()
            await asyncio.gather(launching, return_exceptions=True)
            return
        stopping.cancel()
        cluster = launching.result()
        try:
            cluster.pool = await start_pool(cluster)
            print(f"proxy listening on {cluster.proxy_url}", flush=True)
            if dashboard:
                print(f"Ray dashboard: {dashboard}", flush=True)
            if secrets.proxy_token and not config.proxy.auth_token:
                path = write_token_file(config.run_name, secrets.proxy_token)
                print(
                    f"proxy token (every route but /health and /metrics) in {path}: send it as "
                    f'-H "Authorization: Bearer $(cat {path})"',
                    flush=True,
                )
            await stop.wait()
            print("stopping: shutting down the generators and the proxy", flush=True)
        finally:
            await cluster.shutdown()
    finally:
        ray.shutdown()


def write_token_file(run_name: str, token: str) -> str:
    """A generated proxy token goes into a file only its owner can read, never onto the terminal."""
    path = os.path.abspath(os.path.join(".cache", "tokens", run_name))
    write_private_file(path, token + "\n")  # 0600 even where an older file had another mode
    return path
