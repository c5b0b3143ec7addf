"""Loading one adapter version on many replicas, all-or-nothing.

Each replica retries "not found" (a bucket mount that lags) until a deadline; any other failure stops
the others' retries, and the replicas that did load it unload it again, so a version is either routable
everywhere or nowhere. "Everywhere" means every replica that is up: one that fails because it is down
(its health check fails too) leaves routing and loads the version when it catches up on return; it
must not fail the sync for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from rl_cluster.core.retry import RetriesExhausted, RetryPolicy
from rl_cluster.errors import AdapterNotFound, AdapterRejected, ReplicaServerError, ReplicaTimeout
from rl_cluster.proxy.adapter_loader import AdapterLoader

logger = logging.getLogger(__name__)


class LoadFailed(Exception):
    """A broadcast adapter load failed on some replicas (and was rolled back on the others)."""

    def __init__(
        self, name: str, failures: dict[str, BaseException], rolled_back: list[str], all_down: bool = False
    ):
        self.failures = failures
        self.all_down = all_down  # nothing refused it: every replica was down (worth waiting for one)
        reasons = "; ".join(f"replica {r}: {type(e).__name__}: {e}" for r, e in sorted(failures.items()))
        undone = f"; rolled back on {', '.join(rolled_back)}" if rolled_back else ""
        super().__init__(f"loading adapter {name!r} failed: {reasons}{undone}")

    @property
    def status(self) -> int:
        """404: nothing visible by the deadline; 400: the adapter was refused; 502: a replica misbehaved."""
        errors = self.failures.values()
        if all(isinstance(e, AdapterNotFound) for e in errors):
            return 404
        if all(isinstance(e, (AdapterNotFound, AdapterRejected)) for e in errors):
            return 400
        return 502


async def load_with_retry(
    loader: AdapterLoader,
    name: str,
    path: str,
    *,
    retry_s: float,
    deadline_s: float,
    give_up: asyncio.Event,
) -> None:
    """Load on one replica within `deadline_s`, retrying "not found" every `retry_s` until then, or until
    `give_up` is set (a real failure elsewhere: no point waiting). Any other error fails at once.

    Each attempt is bounded by what is left of the deadline: a replica that does not answer in time
    (stopped, cut off, a stalled mount under its actor) raises ReplicaTimeout, which the broadcast treats
    as down, so one hung replica holds a sync (and the adapter lock) for at most `deadline_s`. One that
    answered "not found" before it stopped answering raises that: the adapter is what is missing.
    """
    deadline = time.monotonic() + deadline_s
    policy = RetryPolicy(deadline_s=deadline_s, first_delay_s=retry_s, max_delay_s=retry_s, factor=1)
    not_found: list[AdapterNotFound] = []  # what the replica answered before the attempt that timed out

    async def attempt() -> None:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
            await loader.load_adapter(name, path)

    async def wait_unless_given_up(delay: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(give_up.wait(), delay)

    try:
        await policy.acall(
            attempt,
            retryable=lambda e: isinstance(e, AdapterNotFound),
            on_retry=lambda e, *_: not_found.append(e),
            stop=give_up.is_set,
            sleep=wait_unless_given_up,
        )
    except RetriesExhausted as e:
        raise e.last from None
    except TimeoutError:
        if not_found:
            raise not_found[-1] from None
        raise ReplicaTimeout(f"no answer to loading {name!r} within load_deadline_s={deadline_s:g}") from None


async def unload_within(loader: AdapterLoader, name: str, deadline_s: float) -> None:
    """Unload on one replica; ReplicaTimeout when it does not answer within `deadline_s`."""
    try:
        async with asyncio.timeout(deadline_s):
            await loader.unload_adapter(name)
    except TimeoutError:
        raise ReplicaTimeout(
            f"no answer to unloading {name!r} within load_deadline_s={deadline_s:g}"
        ) from None


async def load_everywhere(
    name: str,
    path: str,
    loaders: dict[str, AdapterLoader],
    *,
    retry_s: float,
    deadline_s: float,
    loaded: Callable[[str], None],
    holders: Callable[[], list[str]],
    unloaded: Callable[[str], None],
    down: Callable[[str, BaseException], Awaitable[bool]] | None = None,
) -> None:
    """Load on every replica of `loaders` concurrently, calling `loaded(replica)` for each success. A
    replica that fails and is `down(replica, error)` (which takes it out of routing) is left out. On any
    other failure, or when every replica is down, unload from `holders()` (calling `unloaded(replica)`
    for each) and raise LoadFailed."""
    give_up = asyncio.Event()
    left_out: dict[str, BaseException] = {}

    async def load_one(replica_id: str) -> None:
        try:
            await load_with_retry(
                loaders[replica_id], name, path, retry_s=retry_s, deadline_s=deadline_s, give_up=give_up
            )
        except Exception as e:
            # A refusal is the adapter's fault, whatever the replica's health: never left out.
            if (
                down is not None
                and not isinstance(e, (AdapterNotFound, AdapterRejected))
                and await down(replica_id, e)
            ):
                left_out[replica_id] = e
                logger.warning("replica %s is down; adapter %s goes on without it: %s", replica_id, name, e)
                return
            give_up.set()
            if isinstance(e, ReplicaServerError) and down is not None:
                # A 5xx from a replica that is up: vLLM refused the adapter (a 4xx for the client).
                raise AdapterRejected(str(e)) from e
            raise
        except BaseException:
            give_up.set()
            raise
        loaded(replica_id)

    targets = list(loaders)
    results = await asyncio.gather(*(load_one(r) for r in targets), return_exceptions=True)
    failures = {r: e for r, e in zip(targets, results, strict=True) if isinstance(e, BaseException)}
    if not failures and len(left_out) < len(targets):
        return
    rolled_back = await _roll_back(
        name, {r: loaders[r] for r in holders() if r in loaders}, deadline_s, unloaded
    )
    raise LoadFailed(name, failures or left_out, rolled_back, all_down=not failures)


async def _roll_back(
    name: str, holders: dict[str, AdapterLoader], deadline_s: float, unloaded: Callable[[str], None]
) -> list[str]:
    """Unload `name` from the replicas that loaded it, all at once, each within `deadline_s` (one after
    the other, N replicas took N deadlines: the load's answer came too late); returns those it left."""

    async def one(replica_id: str, loader: AdapterLoader) -> bool:
        try:
            await unload_within(loader, name, deadline_s)
        except AdapterNotFound:
            pass  # not there: rolled back all the same
        except Exception:
            # It stays marked loaded (the name stays taken) so that an unload can still remove it.
            logger.exception("rollback of adapter %s on replica %s failed", name, replica_id)
            return False
        unloaded(replica_id)
        return True

    done = await asyncio.gather(*(one(r, loader) for r, loader in holders.items()))
    return [r for r, ok in zip(holders, done, strict=True) if ok]
