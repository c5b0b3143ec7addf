"""Serve the generators behind the proxy, without training: one OpenAI-compatible endpoint.

    python jobs/serve.py --config jobs/configs/cpu_demo.toml [--port P] [section.field=value ...]

Joins a running Ray cluster if there is one, else starts a local one; starts the configured vLLM
generators and the proxy, prints `proxy listening on http://HOST:PORT` (and, when proxy.auth_token is
unset, the file holding the generated control-route token), and serves until SIGINT or SIGTERM. Then it
stops every vLLM server and actor it started and leaves Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from rl_cluster.config import load_config


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="run TOML under jobs/configs/")
    parser.add_argument("--port", type=int, help="port the proxy binds (overrides proxy.port)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. generator.replicas=1")
    # Intermixed: overrides may come before and after --port.
    return parser.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides) + ([f"proxy.port={args.port}"] if args.port is not None else [])
    config = load_config(args.config, overrides)
    from rl_cluster.run import serve

    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
