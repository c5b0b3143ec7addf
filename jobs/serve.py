"""Serve the generators behind the proxy, without training: one OpenAI-compatible endpoint.

    python jobs/serve.py --config jobs/configs/cpu_demo.toml [--port P] [section.field=value ...]

Joins a running Ray cluster if there is one, else starts a local one; starts the configured vLLM
generators and the proxy, prints `proxy listening on http://HOST:PORT`, and serves until SIGINT or
SIGTERM. Then it stops every vLLM server and actor it started and leaves Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_cluster.config import load_config  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="run TOML under jobs/configs/")
    parser.add_argument("--port", type=int, help="port the proxy binds (overrides proxy.port)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. generator.replicas=1")
    # Intermixed: overrides may come before and after --port.
    return parser.parse_intermixed_args(argv)


async def serve(config) -> None:
    import ray

    from rl_cluster.cluster import connect, launch

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    connect(config)
    log_dir = os.path.abspath(os.path.join(".cache", "logs", config.run_name))
    try:
        # A signal during the ~30 s start cancels it; launch() shuts down what it started when cancelled.
        launching = asyncio.create_task(launch(config, log_dir))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({launching, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not launching.done():
            launching.cancel()
            await asyncio.gather(launching, return_exceptions=True)
            return
        stopping.cancel()
        cluster = launching.result()
        try:
            print(f"proxy listening on {cluster.proxy_url}", flush=True)
            await stop.wait()
            print("stopping: shutting down the generators and the proxy", flush=True)
        finally:
            await cluster.shutdown()
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides) + ([f"proxy.port={args.port}"] if args.port is not None else [])
    config = load_config(args.config, overrides)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
