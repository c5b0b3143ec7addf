"""The answers the proxy gives itself, in vLLM's (OpenAI's) shapes, so clients parse them like a server's."""

from __future__ import annotations

from typing import Any

from aiohttp import web


def error_response(
    status: int, message: str, err_type: str = "BadRequestError", param: str | None = None, **extra: Any
) -> web.Response:
    """An error in vLLM's (OpenAI's) JSON shape; `extra` adds top-level fields (per-replica reasons)."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}, **extra}
    return web.json_response(body, status=status)


def no_active_replica(waited_s: float | None = None) -> web.Response:
    if waited_s is None:
        return error_response(503, "no active replica", "ServiceUnavailableError")
    message = (
        f"no generator replica has been active for {waited_s:.0f} s (proxy.unavailable_timeout_s): every "
        "replica is down or restarting; see the generators' vLLM logs"
    )
    return error_response(503, message, "ServiceUnavailableError")


def reply(status: int, payload: Any) -> web.Response:
    """Pass on what a replica answered: JSON as JSON, anything else as text."""
    if isinstance(payload, str):
        return web.Response(status=status, text=payload)
    return web.json_response(payload, status=status)
