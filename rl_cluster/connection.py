"""Joining a Ray cluster, and what the run asks it for.

`connect` joins the configured or running cluster, else starts a private local one. Placement: the
trainer on a node with the custom resource `trainer`, one generator per `generator` resource, and the
proxy on a node with a `proxy` resource when the cluster has one, else on the driver's node (pinned there,
so its address is known and stable for the run). `check_placeable` refuses, in seconds, a run that no
node and no autoscaler node type can hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from typing import NamedTuple

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rl_cluster.config import RunConfig
from rl_cluster.core.placement import Request, adds_nodes, refusal, unplaceable
from rl_cluster.errors import RunRefused
from rl_cluster.models import hf_environment


def runtime_env() -> dict:
    return {
        "env_vars": {
            # TRL 1.16 warns on every import that it was tested with vLLM <= 0.31 (we run 0.32, verified),
            # and that its async trainer is experimental: once per process, in every actor's log.
            "TRL_EXPERIMENTAL_SILENCE": "1",
            "PYTHONWARNINGS": "ignore:TRL currently supports vLLM versions",
            "TOKENIZERS_PARALLELISM": "false",
            # Every node resolves a hub model the way the driver's environment says (cache, offline); the
            # token is no env_var here, where the dashboard shows it: RunSecrets hands it to the actors.
            **hf_environment(),
        }
    }


class Connection(NamedTuple):
    local: bool
    """True when connect() started a private local Ray: then, and only then, servers may bind loopback."""
    dashboard: str | None
    """Where that cluster's Ray dashboard answers (None: not known, or it runs without one)."""


def connect(config: RunConfig) -> Connection:
    """Join the configured or running Ray cluster; else start a private local one that declares the
    trainer and generator resources itself (a laptop has no node types)."""
    if ray.is_initialized():
        return Connection(False, None)
    if (
        not sys.stdout.isatty()
    ):  # `ray job logs`, a file, a pipe: the actors' log prefixes without ANSI colours
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    env = runtime_env()
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        return Connection(False, _dashboard(ray.init(address=address, runtime_env=env)))
    # Join a cluster started with `ray start` on this machine, but never scan for other users' Ray
    # processes (what address="auto" does when the address file is missing).
    if address is None and os.path.exists(os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")):
        try:
            return Connection(False, _dashboard(ray.init(address="auto", runtime_env=env)))
        except ConnectionError:
            pass
    context = ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        # Room for the most generators the pool controller may run (a laptop has no autoscaler).
        resources={
            "trainer": config.trainer.num_workers,
            "generator": config.generator.replica_bounds[1] * config.generator.tensor_parallel_size,
        },
        runtime_env=env,
    )
    return Connection(True, _dashboard(context))


def _dashboard(context) -> str | None:
    url = getattr(context, "dashboard_url", None)  # "host:port", or "" when Ray runs without one
    return f"http://{url}" if url else None


def placement_requests(config: RunConfig) -> list[Request]:
    """What each of the run's actors asks Ray for, as launch() and the trainer's options ask it."""
    proxy = {"CPU": config.proxy.num_cpus}
    here = None
    if "resources" in (options := proxy_options()):
        proxy.update(options["resources"])
    else:
        here = ray.get_runtime_context().get_node_id()
    generator = {"generator": config.generator.tensor_parallel_size, "GPU": config.generator.num_gpus}
    t = config.trainer  # its ranks: on one node (STRICT_PACK), or as many as it takes (span_nodes: PACK)
    rank = {"trainer": 1, "CPU": t.num_cpus, "GPU": t.num_gpus}
    if t.span_nodes:
        trainer = Request("trainer", rank, copies=t.num_workers)
    else:
        trainer = Request("trainer", {name: t.num_workers * amount for name, amount in rank.items()})
    return [Request("proxy", proxy, here), Request("generator", generator), trainer]


async def check_placeable(config: RunConfig, wait_for_report_s: float = 15.0) -> None:
    """RunRefused, in seconds, where no live node and no autoscaler node type can ever hold one of the
    run's actors (rl_cluster.core.placement); Ray itself would wait for ever.

    Node types: those an autoscaler published to the GCS (autoscaler v2, KubeRay), read the way Ray Train
    does (`ray._private.state`: Ray has no public API for them). Else the autoscaling status the monitor of
    every head writes: the read-only autoscaler of a plain `ray start --head` adds no node, so only the
    live nodes count; one with a cluster config (`ray up`) may add nodes whose types it does not publish,
    and then, as while no status is there yet, nothing is refused."""
    from ray._private import ray_constants
    from ray._private.state import state
    from ray.experimental.internal_kv import _internal_kv_get

    node_types: list[dict] = []
    with contextlib.suppress(Exception):
        cluster_config = state.get_cluster_config()
        node_types = [dict(g.resources) for g in cluster_config.node_group_configs if g.max_count != 0]
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    missing = unplaceable(placement_requests(config), nodes, node_types)
    if not missing:
        return
    if not node_types:
        deadline = time.monotonic() + wait_for_report_s
        while True:
            status: dict = {}
            with contextlib.suppress(Exception):
                status = json.loads(_internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS) or "{}")
            adds = adds_nodes(status.get("autoscaler_report"))
            if adds is not None or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        if adds is not False:
            return  # an autoscaler that may add nodes of types it does not say, or none known: Ray waits
    raise RunRefused(refusal(missing))


def proxy_options() -> dict:
    """A node with the `proxy` resource if the cluster has one, else the driver's own node."""
    if any(node["Alive"] and node["Resources"].get("proxy") for node in ray.nodes()):
        return {"resources": {"proxy": 1}}
    here = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=here, soft=False)}
