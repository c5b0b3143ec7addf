"""A generator ends with its run: the detached generator actors (rl_cluster.pool_state) outlive whoever
started them, so each one watches its run's proxy and stops when that is gone for good.

The proxy is an actor of the run's driver: Ray restarts it when its process dies (calls wait for that),
and ends it for good when its driver died (SIGKILLed, its node lost) or its restarts ran out. Then the
run is over, and a generator left running would hold its node's `generator` resource, its core or GPU,
and a vLLM server, for ever. (The next driver of the run stops them too, by name, before it starts its
own; this is for a run that nobody resumes.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import ray

RUN_WATCH_S = 5.0
# A call to a proxy that Ray is restarting waits for the restart: that is not the end of the run.
CALL_TIMEOUT_S = 30.0


async def until_the_run_ends(proxy, every_s: float = RUN_WATCH_S) -> str:
    """Return, with Ray's reason, once the run's proxy is dead for good."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.wait_for(proxy.awaiting_restore.remote(), CALL_TIMEOUT_S)
        except ray.exceptions.ActorDiedError as e:
            return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        except Exception:  # noqa: BLE001  restarting, unreachable for now, slow: the run goes on
            continue


async def end_with_the_run(proxy, replica_id: str, stop: Callable[[], Awaitable[None]]) -> None:
    """A generator's task: once its run's proxy is gone for good, `stop` its server and end its actor."""
    why = await until_the_run_ends(proxy)
    print(f"replica {replica_id}: the run's proxy is gone for good ({why}); stopping", flush=True)
    await stop()
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
