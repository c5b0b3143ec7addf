"""Serve the generators behind the proxy, without training: one OpenAI-compatible endpoint.

    python jobs/serve.py --config jobs/configs/cpu_demo.toml [--port P] [section.field=value ...]

Joins a running Ray cluster if there is one, else starts a local one; starts the configured vLLM
generators and the proxy, prints `proxy listening on http://HOST:PORT` (and, when proxy.auth_token is
unset and the proxy binds beyond loopback, the file holding the generated token that every route but
/health and /metrics demands), and serves until SIGINT or SIGTERM. Then it
stops every vLLM server and actor it started and leaves Ray. The same as `rl-cluster serve`; a config
that does not load is one line per problem and exit status 2.
"""

from __future__ import annotations

import sys

from rl_cluster.cli import main

if __name__ == "__main__":
    # The same command as `rl-cluster serve`, whose arguments are defined once (rl_cluster.commands); this
    # script stays for `ray job submit`, where the console script may not be installed.
    sys.exit(main(["serve", *sys.argv[1:]]))
