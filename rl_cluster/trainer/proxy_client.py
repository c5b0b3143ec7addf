"""The trainer's calls to the proxy's control routes.

TRL's VLLMClient sends no Authorization header, so with `proxy.auth_token` set its load/unload calls
would get 401; the trainer's adapter lifecycle uses this client instead (TRL's stays for its probes at
start-up, /health, /server_info and /v1/models, through compat's AuthorizedVLLMClient).

The proxy answers a load within proxy.load_timeout_s, below this client's timeout. Should the answer
still be lost to a timeout (a proxy stalled, a network that dropped it), the client asks the proxy
whether the version is routable before it fails the sync: the load may have succeeded.

Where the proxy is: `ProxyAddress`, which rank 0 moves when the proxy's actor says it serves elsewhere
(Ray restarted it on another `proxy` node); every try of a call reads it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import requests

from rl_cluster.config import TRAINER_CONTROL_TIMEOUT_S
from rl_cluster.core.retry import RetriesExhausted, RetryPolicy
from rl_cluster.trainer.http import HttpClient, unreachable

logger = logging.getLogger(__name__)


class ProxyControlError(RuntimeError):
    pass


class ProxyAddress:
    """The proxy's base URL as the trainer last heard it, read by each try of its clients' calls (a
    callable: HttpClient's `base_url`). `followers` hear each move (the rollout child's shared copy)."""

    def __init__(self, url: str):
        self._url = url.rstrip("/")
        self.followers: list[Callable[[str], None]] = []

    def __call__(self) -> str:
        return self._url

    def move(self, url: str) -> bool:
        """The proxy serves at `url` now; False when that is where it was."""
        url = url.rstrip("/")
        if url == self._url:
            return False
        self._url = url
        for follower in self.followers:
            follower(url)
        return True


class ProxyClient:
    def __init__(
        self,
        url: str | ProxyAddress,
        auth_token: str | None = None,
        timeout_s: float = TRAINER_CONTROL_TIMEOUT_S,
        reconnect_s: float = 180.0,
    ):
        """`reconnect_s`: how long a call keeps trying while the proxy does not answer at all (Ray
        restarts a proxy whose process died, on the same address: proxy.max_restarts). Only an unreachable
        proxy is retried: loads are safe to repeat (the proxy answers a load of a name it holds from the
        same path with success), but a proxy that answered has decided. `url`: a ProxyAddress follows
        the proxy where it moves."""
        self.address = url if isinstance(url, ProxyAddress) else ProxyAddress(url)
        self.http = HttpClient(
            self.address,
            auth_token,
            timeout_s=timeout_s,
            retry=RetryPolicy(deadline_s=reconnect_s, first_delay_s=1.0, max_delay_s=10.0),
            retryable=unreachable,
        )
        self.auth_token = auth_token  # also what the rollout loop and the eval send (compat item 19)
        self.reconnect_s = reconnect_s
        self.timeout_s = timeout_s

    @property
    def url(self) -> str:
        return self.http.base_url

    def _request(self, method: str, route: str, **kwargs) -> requests.Response:
        try:
            return self.http.request(method, route, **kwargs)
        except RetriesExhausted as e:
            raise ProxyControlError(
                f"proxy {self.url} unreachable for {self.reconnect_s:.0f} s ({route}): {e.last}"
            ) from e.last

    def _post(self, route: str, payload: dict) -> None:
        try:
            self._request("POST", route, json=payload)
        except requests.HTTPError as e:
            response = e.response
            raise ProxyControlError(
                f"proxy {route} {payload} failed: HTTP {response.status_code}: {response.text}"
            ) from e

    def load_adapter(self, name: str, path: str) -> None:
        """Returns once every active replica verified and loaded `name`; it is routable from then on. When
        no answer came in time, the proxy is asked whether `name` is routable: a load that succeeded
        returns, one that did not raises ProxyControlError."""
        try:
            self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except requests.Timeout as e:
            if name not in self.routable_adapters():
                raise ProxyControlError(
                    f"proxy gave no answer to loading {name!r} within {self.timeout_s:g} s, and does not "
                    "route it: the load failed or is still under way"
                ) from e
            logger.warning("proxy gave no answer to loading %s within %g s, but routes it: loaded",
                           name, self.timeout_s)  # fmt: skip

    def unload_adapter(self, name: str) -> None:
        """Closes `name` to new requests; replicas unload it once its in-flight requests finish."""
        self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def _replicas(self) -> dict:
        return self._request("GET", "/replicas", timeout_s=30).json()

    def replicas(self) -> dict[str, dict]:
        """Per replica: url, state, requests, in_flight, adapters_loaded, ... (the proxy's /replicas)."""
        return self._replicas()["replicas"]

    def active_replica_urls(self) -> list[str]:
        return [r["url"] for r in self.replicas().values() if r["state"] == "active"]

    def routable_adapters(self) -> set[str]:
        """Adapter names open to new requests (loaded and not unloaded)."""
        return set(self._replicas()["adapters_routable"])

    def loaded_adapters(self) -> set[str]:
        """Adapter names some replica still holds (an unloaded name stays until its last request ends)."""
        return {name for r in self.replicas().values() for name in r["adapters_loaded"]}
