"""One replica as the proxy sees it: its record, and what the proxy asks it about itself.

The pool (rl_cluster.proxy.replicas) keeps these records. How many sequences a replica runs at once
(/server_info) and whether it is up (/health) are asked the same way by registration, catch-up and the
health watch, so the asking lives here, below all three (what it serves, /v1/models, is asked by the
adapter loader, which checks every load against it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp

from rl_cluster.errors import ReplicaDown
from rl_cluster.proxy.adapter_loader import INFO_TIMEOUT, AdapterLoader

logger = logging.getLogger(__name__)


class Member(NamedTuple):
    """What a proxy needs to route to a replica, as its generator tells it (GeneratorActor.membership
    answers this shape as a plain tuple: `Member(*answer)`)."""

    url: str
    control: AdapterLoader | None
    """Loads adapters on it (None: straight through its vLLM HTTP routes)."""
    capacity: int | None
    held: dict[str, str]
    """The adapter versions its server holds -> the bucket paths they came from."""


class NotReached:
    """The loader of a replica registered down before the proxy reached it: nothing is sent to a replica
    that is down (broadcasts go to active ones), and its catch-up registers it anew with its own."""

    async def load_adapter(self, name: str, path: str) -> None:
        raise ReplicaDown("not reached yet: where it serves is not known")

    async def unload_adapter(self, name: str) -> None:
        raise ReplicaDown("not reached yet: where it serves is not known")


@dataclass
class Replica:
    replica_id: str
    url: str
    """"" while not known: a replica registered down because its generator did not answer (the health
    watch asks it again, rl_cluster.proxy.replicas.ReplicaPool.rejoin)."""
    loader: AdapterLoader
    capacity: int | None = None
    """Concurrent sequences it runs (vLLM max_num_seqs): routing compares loads relative to it. None
    until known (the replica reported none and its /server_info has not answered yet)."""


async def learn_capacity(session: aiohttp.ClientSession, replica: Replica) -> None:
    """Ask vLLM for its max_num_seqs. Meant for the background: vLLM builds /server_info's environment
    report on first use (~2 s here), and registration must not wait for it; until then the replica
    counts as the smallest one known."""
    url = f"{replica.url}/server_info?config_format=json"
    try:
        async with session.get(url, timeout=INFO_TIMEOUT) as response:
            response.raise_for_status()
            info = await response.json()
        replica.capacity = int(info["vllm_config"]["scheduler_config"]["max_num_seqs"])
        logger.info("replica %s runs up to %d sequences at once", replica.replica_id, replica.capacity)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as e:
        logger.warning("capacity of replica %s unknown (%s: %s)", replica.replica_id, type(e).__name__, e)


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """None when GET /health answers 200 within `timeout_s`, else what went wrong."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(f"{url}/health", timeout=timeout) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except (aiohttp.ClientError, ConnectionError) as e:
        return f"{type(e).__name__}: {e}"
