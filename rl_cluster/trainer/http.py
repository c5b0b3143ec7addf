"""The trainer's one HTTP client: a server's base URL, the run's bearer token, a timeout, and what to retry.

The trainer talks to the proxy (control routes, held-out eval) and, for the served-vs-trained check, to
each replica directly; every such call goes through `HttpClient`, so the header, the timeouts and the
retries are spelled once. An answer that is not 2xx raises requests.HTTPError (its `response` says
what came back): every caller treats one as a failure. What is worth another try differs by caller
(a control call waits out a proxy restart, an eval also retries the proxy's 5xx, the check retries
nothing), so each client is given its `RetryPolicy` and a `retryable` test, built from the two below.

TRL's rollout loop keeps its own aiohttp session and retries (compat item 19 adds the header to it):
those run on the rollout worker's event loop, where this blocking client has no place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import requests

from rl_cluster.core.auth import bearer_headers
from rl_cluster.core.retry import Retryable, RetryPolicy

logger = logging.getLogger(__name__)


def unreachable(e: Exception) -> bool:
    """Nothing answered (refused, reset, no route): the server is down or restarting."""
    return isinstance(e, requests.ConnectionError)


def no_answer(e: Exception) -> bool:
    """Unreachable, too slow, or a 5xx: the server (or what is behind it) failed, not the request."""
    if isinstance(e, requests.HTTPError):
        return e.response is not None and e.response.status_code >= 500
    return isinstance(e, (requests.ConnectionError, requests.Timeout))


def describe(e: BaseException) -> str:
    """One line for an error of this client: `HTTP 503: <the start of the body>`, or the exception."""
    if isinstance(e, requests.HTTPError) and e.response is not None:
        return f"HTTP {e.response.status_code}: {e.response.text[:200]}"
    return f"{type(e).__name__}: {e}"


class HttpClient:
    """Calls to one server. `base_url`: its URL, or a function that says where it is now (each try asks
    it: the proxy may move, see rl_cluster.trainer.proxy_client.ProxyAddress). `retry`: the bound on tries
    of one call (None: one try, errors as they come); `retryable`: which errors are worth another
    (`unreachable`, `no_answer`, or the caller's own)."""

    def __init__(
        self,
        base_url: str | Callable[[], str],
        token: str | None = None,
        *,
        timeout_s: float = 600.0,
        retry: RetryPolicy | None = None,
        retryable: Retryable = unreachable,
    ):
        self._where = base_url
        self.headers = bearer_headers(token)
        self.timeout_s = timeout_s
        self.retry = retry
        self.retryable = retryable

    @property
    def base_url(self) -> str:
        where = self._where
        return (where if isinstance(where, str) else where()).rstrip("/")

    def __repr__(self) -> str:
        return f"HttpClient({self.base_url!r})"

    def request(
        self, method: str, route: str, *, timeout_s: float | None = None, **kwargs
    ) -> requests.Response:
        """`method base_url+route` with the token, under the client's retries; `kwargs` go to requests
        (json=...). rl_cluster.core.retry.RetriesExhausted (its `last` is the last error) when the retries
        ran out."""

        def once() -> requests.Response:
            response = requests.request(
                method,
                f"{self.base_url}{route}",
                headers=self.headers,
                timeout=timeout_s or self.timeout_s,
                **kwargs,
            )
            response.raise_for_status()
            return response

        def warn(e: Exception, attempt: int, delay: float) -> None:
            logger.warning(
                "%s %s%s: %s; trying again in %.0f s (attempt %d)",
                method,
                self.base_url,
                route,
                describe(e),
                delay,
                attempt,
            )

        if self.retry is None:
            return once()
        return self.retry.call(once, retryable=self.retryable, on_retry=warn)

    def post(self, route: str, payload: dict, *, timeout_s: float | None = None) -> dict:
        """POST `payload` as JSON; the answer's JSON."""
        return self.request("POST", route, json=payload, timeout_s=timeout_s).json()
