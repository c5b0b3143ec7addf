"""The answers the proxy gives itself, in vLLM's (OpenAI's) shapes, so clients parse them like a server's."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from rl_cluster.proxy.validation import parse_json_object


def error_response(
    status: int, message: str, err_type: str = "BadRequestError", param: str | None = None, **extra: Any
) -> web.Response:
    """An error in vLLM's (OpenAI's) JSON shape; `extra` adds top-level fields (per-replica reasons)."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}, **extra}
    return web.json_response(body, status=status)


def no_active_replica(
    waited_s: float | None = None, bound: str = "proxy.unavailable_timeout_s"
) -> web.Response:
    """503 for a call that found no active replica; `waited_s`, when it waited for one, is what it waited and
    `bound` the setting that ended the wait."""
    if waited_s is None:
        return error_response(503, "no active replica", "ServiceUnavailableError")
    message = (
        f"no generator replica has been active for {waited_s:.0f} s ({bound}): every "
        "replica is down or restarting; see the generators' vLLM logs"
    )
    return error_response(503, message, "ServiceUnavailableError")


def reply(status: int, payload: Any) -> web.Response:
    """Pass on what a replica answered: JSON as JSON, anything else as text."""
    if isinstance(payload, str):
        return web.Response(status=status, text=payload)
    return web.json_response(payload, status=status)


class Answer(Exception):
    """Raised while handling a request to answer it at once with `response` (the server's middleware
    catches it)."""

    def __init__(self, response: web.Response):
        self.response = response


def too_large(limit: int) -> web.Response:
    # Built only when needed: an answer made in advance for every request cost more than its routing.
    return error_response(413, f"request body over {limit} bytes", "RequestTooLarge")


async def read_json(request: web.Request, limit: int) -> tuple[bytes, dict]:
    """The request's raw body and its JSON object; raises Answer (a 413 or 400) when it is not one."""
    if request.content_length is not None and request.content_length > limit:
        raise Answer(too_large(limit))
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise Answer(too_large(limit)) from None
    return raw, parse_json_object(raw)
