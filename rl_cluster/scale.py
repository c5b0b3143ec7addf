"""`rl-cluster scale` (`jobs/scale.py`): an operator's view of a running run's generator pool, and a hand
on its size. Another driver: it joins the run's Ray cluster and finds the pool controller by name."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import ray

from rl_cluster.core.names import NAMESPACE, pool_actor_name


def connect_to_pool(run_name: str):
    """The pool controller of a running run (the caller is connected to its Ray cluster)."""
    try:
        return ray.get_actor(pool_actor_name(run_name), namespace=NAMESPACE)
    except ValueError:
        raise LookupError(
            f"no pool controller {pool_actor_name(run_name)!r} in this Ray cluster: is run {run_name!r} running?"
        ) from None


def scale(run_name: str, replicas: int | None, auto: bool = False, address: str | None = None,
          wait: bool = True, timeout_s: float = 900.0) -> int:  # fmt: skip
    """`jobs/scale.py`: set the pool of a running run to `replicas` (or back to automatic), wait until it
    is there; with neither, print the pool's status as JSON. Returns the process's exit status."""
    # Never address=None: with no RAY_ADDRESS that starts a new local cluster, with no run in it.
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        try:
            pool = connect_to_pool(run_name)
        except LookupError as e:
            print(e, file=sys.stderr)
            return 1
        if replicas is None and not auto:
            print(json.dumps(ray.get(pool.status.remote()), indent=2))
            return 0
        try:
            before = ray.get(pool.set_target.remote(None if auto else replicas))
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ValueError):
                print(f"refused: {e.cause}", file=sys.stderr)
                return 2
            raise
        print(f"run {run_name}: {'automatic scaling' if auto else f'target {replicas} replicas'} "
              f"(serving {len(before['serving'])})", flush=True)  # fmt: skip
        if auto or not wait:
            return 0
        deadline, shown = time.monotonic() + timeout_s, None
        while True:
            status = ray.get(pool.status.remote())
            now = {k: status[k] for k in ("serving", "starting", "leaving", "unavailable")}
            if now != shown:
                print("  " + "  ".join(f"{k} {v}" for k, v in now.items()), flush=True)
                shown = now
            if len(status["serving"]) == replicas and not status["starting"] and not status["leaving"]:
                print(f"run {run_name}: {replicas} replicas serving", flush=True)
                return 0
            if time.monotonic() > deadline:
                print(f"run {run_name}: not at {replicas} replicas after {timeout_s:.0f} s", file=sys.stderr)
                return 1
            time.sleep(1)
    finally:
        ray.shutdown()
