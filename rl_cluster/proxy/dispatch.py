"""One generation request's way to a replica: choose one, forward, and try another if it failed early.

The choice is prefix affinity with the imbalance guard (rl_cluster.core.routing) among the replicas
eligible for the requested adapter: active, and holding it (rl_cluster.proxy.replicas). A replica that
fails before the client got a byte (rl_cluster.proxy.forward.ReplicaFailed) has the request sent to
another eligible one, each replica at most once; whether the failed one is down is the pool's call. A healthy
replica that answered nothing at all (its connection broke under the request) has the request sent once
more, to it when no other is eligible.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

from rl_cluster.config import ProxyConfig
from rl_cluster.core.routing import block_hashes, request_prompt, route
from rl_cluster.proxy.answers import error_response, no_active_replica
from rl_cluster.proxy.forward import ReplicaFailed, forward
from rl_cluster.proxy.metrics import ROUTE_REASONS
from rl_cluster.proxy.replicas import Replica, ReplicaPool

logger = logging.getLogger(__name__)


class Dispatcher:
    """Routes generations over `pool` through `session` (the data session, set once the proxy has one),
    and counts how: routing reasons, retries (by the replica that failed and how), streams broken mid-way."""

    def __init__(self, config: ProxyConfig, pool: ReplicaPool):
        self.config = config
        self.pool = pool
        self.session: aiohttp.ClientSession | None = None
        self.route_reasons: Counter[str] = Counter()
        # (the replica that failed, ReplicaFailed.cause) -> requests then sent to another replica
        self.retried: Counter[tuple[str, str]] = Counter()
        self.streams_broken = 0

    def stats(self) -> dict:
        return {
            "routing": {reason: self.route_reasons[reason] for reason in ROUTE_REASONS},
            "retries": self.retries,
            "retried": self.retried_by_replica(),
            "streams_broken": self.streams_broken,
        }

    @property
    def retries(self) -> int:
        return self.retried.total()

    def retried_by_replica(self) -> dict[str, dict[str, int]]:
        """{replica that failed: {cause: requests retried elsewhere}}."""
        by_replica: dict[str, dict[str, int]] = {}
        for (replica_id, cause), count in self.retried.items():
            by_replica.setdefault(replica_id, {})[cause] = count
        return by_replica

    async def generate(
        self, request: web.Request, raw: bytes, body: dict, max_events: int | None = None
    ) -> web.StreamResponse:
        """Answer a checked generation request (`raw` its body as sent, `body` that body parsed); a streamed
        answer is cut off after `max_events` events."""
        pool = self.pool
        model = body.get("model")
        adapter, hashes = self._target(model, body)
        tried: list[str] = []
        failure: ReplicaFailed | None = None
        waited = resent = False
        # Bounded: each replica is tried at most once (one of them twice, after a connection that broke
        # without an answer), and only after the previous one failed before the client received anything
        # (ReplicaFailed).
        while True:
            eligible = pool.book.eligible(adapter)
            decision = route(
                hashes,
                pool.table,
                pool.book.loads,
                eligible - set(tried) if tried else eligible,
                self.config.imbalance_threshold,
                self.config.routing_policy,
            )
            if decision is None and not pool.book.active() and not waited:
                waited = True  # every replica down: wait for one to come back (bounded), once
                if await pool.wait_for_active():
                    tried.clear()
                    adapter, hashes = self._target(model, body)  # it may be the first to name the base
                    continue
                return no_active_replica(waited_s=self.config.unavailable_timeout_s)
            if decision is None:
                return self._no_replica_answer(model, adapter, failure)
            if failure is not None:
                self.retried[failure.replica_id, failure.cause] += 1
                logger.warning("retrying on replica %s after: %s", decision.replica_id, failure)
            else:
                self.route_reasons[decision.reason] += 1
            pool.table.record(hashes, decision.replica_id)
            tried.append(decision.replica_id)
            try:
                replica = pool.replicas[decision.replica_id]
                return await self._forward_counted(request, replica, raw, adapter, max_events)
            except ReplicaFailed as e:
                failure = e
                if await pool.replica_failed(e):
                    continue  # down, and out of routing: another replica, if one is eligible
                if e.answer is None and not e.timed_out and not resent:
                    # A healthy replica that answered nothing at all (a kept-alive connection it had closed,
                    # a reset): the client got nothing either, so it is sent once more, elsewhere if it can.
                    resent = True
                    if not pool.book.eligible(adapter) - set(tried):
                        tried.remove(decision.replica_id)
                    continue
                # A 5xx from a replica that is fine otherwise: the request's own problem, passed on.
                logger.warning("passing on a failure of healthy replica %s: %s", decision.replica_id, e)
                return e.answer or error_response(502, str(e), "BadGatewayError")

    def _target(self, model: Any, body: dict) -> tuple[str | None, list[int]]:
        """The adapter a request asks for (None: the base model) and its prompt's block hashes."""
        adapter = None if model is None or model in self.pool.base_models else model
        return adapter, block_hashes(adapter or "", request_prompt(body), self.config.block_size)

    def _no_replica_answer(
        self, model: Any, adapter: str | None, failure: ReplicaFailed | None
    ) -> web.Response:
        if failure is not None:
            return failure.answer or error_response(
                502, f"every eligible replica failed; last: {failure}", "BadGatewayError"
            )
        if adapter is not None and not self.pool.book.is_routable(adapter):
            # The same answer vLLM gives for a name it does not serve.
            aliases = ", ".join(self.pool.base_models)
            message = f"The model `{model}` does not exist. Valid aliases: {aliases}."
            return error_response(404, message, "NotFoundError", "model")
        return no_active_replica()

    async def _forward_counted(
        self, request: web.Request, replica: Replica, raw: bytes, adapter: str | None, max_events: int | None
    ) -> web.StreamResponse:
        """Forward one attempt, counted in flight on its replica for its adapter while it runs."""
        self.pool.begin_request(replica, adapter)
        try:
            response, broken = await forward(
                request, self.session, replica.replica_id, replica.url, raw, max_events
            )
        finally:
            self.pool.end_request(replica, adapter)
        if broken is not None:
            self.streams_broken += 1
            logger.warning("stream ended with an error: %s", broken)
            self.pool.spawn(self.pool.replica_failed(broken))
        return response
