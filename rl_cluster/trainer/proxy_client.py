"""The trainer's calls to the proxy's control routes.

TRL's VLLMClient sends no Authorization header, so with `proxy.auth_token` set its load/unload calls
would get 401; the trainer's adapter lifecycle uses this client instead (TRL's stays for its probes at
start-up, /health, /server_info and /v1/models, through compat's AuthorizedVLLMClient).
"""

from __future__ import annotations

import requests

from rl_cluster.core.auth import bearer_headers


class ProxyControlError(RuntimeError):
    pass


class ProxyClient:
    def __init__(self, url: str, auth_token: str | None = None, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.auth_token = auth_token  # also what the rollout loop and the eval send (compat item 19)
        self.headers = bearer_headers(auth_token)
        self.timeout_s = timeout_s

    def _post(self, route: str, payload: dict) -> None:
        response = requests.post(
            f"{self.url}{route}", json=payload, headers=self.headers, timeout=self.timeout_s
        )
        if response.status_code != 200:
            raise ProxyControlError(
                f"proxy {route} {payload} failed: HTTP {response.status_code}: {response.text}"
            )

    def load_adapter(self, name: str, path: str) -> None:
        """Returns once every active replica verified and loaded `name`; it is routable from then on."""
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> None:
        """Closes `name` to new requests; replicas unload it once its in-flight requests finish."""
        self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def replicas(self) -> dict[str, dict]:
        """Per replica: url, state, requests, in_flight, adapters_loaded, ... (the proxy's /replicas)."""
        response = requests.get(f"{self.url}/replicas", headers=self.headers, timeout=30)
        response.raise_for_status()
        return response.json()["replicas"]

    def active_replica_urls(self) -> list[str]:
        return [r["url"] for r in self.replicas().values() if r["state"] == "active"]

    def routable_adapters(self) -> set[str]:
        """Adapter names open to new requests (loaded and not unloaded)."""
        response = requests.get(f"{self.url}/replicas", headers=self.headers, timeout=30)
        response.raise_for_status()
        return set(response.json()["adapters_routable"])

    def loaded_adapters(self) -> set[str]:
        """Adapter names some replica still holds (an unloaded name stays until its last request ends)."""
        return {name for r in self.replicas().values() for name in r["adapters_loaded"]}
