"""The run's secrets, and the files that hold them.

A run has a replica key, which every vLLM server demands on every route but /health and only the proxy
and the trainer's served-vs-trained check hold, and a proxy token for the proxy's control routes (the
configured one, else a fresh one). Neither appears in a log, a config dump or the summary; both, with the
driver's HF_TOKEN and WANDB_API_KEY, reach the actors as constructor arguments (rl_cluster.cluster).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import tempfile
from dataclasses import dataclass, field

from rl_cluster.config import RunConfig
from rl_cluster.models import secret_environment


@dataclass(frozen=True)
class RunSecrets:
    """The run's two secrets, and the driver's HF_TOKEN / WANDB_API_KEY (repr hides them: dataclasses
    print their fields in tracebacks and logs). All reach the actors as constructor arguments, which Ray's
    dashboard, job API and state API do not show (a runtime_env's env_vars they show to anyone)."""

    replica_key: str | None = field(default=None, repr=False)
    proxy_token: str | None = field(default=None, repr=False)
    environment: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def for_run(cls, config: RunConfig, generate_token: bool = True) -> RunSecrets:
        """A fresh replica key; the configured proxy token, else a fresh one when `generate_token` (a
        proxy serving only loopback may leave its control routes open to this machine)."""
        configured = config.proxy.auth_token
        token = configured.get_secret_value() if configured else None
        if token is None and generate_token:
            token = secrets.token_urlsafe(32)
        return cls(replica_key=secrets.token_urlsafe(32), proxy_token=token, environment=secret_environment())


def proxy_binds_loopback(config: RunConfig, loopback: bool) -> bool:
    """Whether the proxy listens on loopback only, as ProxyActor resolves its host (`loopback`: a private
    local Ray, where an unset host means 127.0.0.1)."""
    host = config.proxy.host
    if host is None:
        return loopback
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False  # a host name: whatever it resolves to, other machines may reach it


def write_private_file(path: str, text: str) -> None:
    """Write `text` to `path`, leaving a file only its owner can read (0600), whatever was there before.

    Opening an existing file keeps its old mode (a 0644 one stays world-readable) and follows a symlink
    planted at the path, so the text goes to a fresh file (mkstemp makes it 0600) renamed over the path.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
