"""One attempt at a generation on one replica, and where the line between "retry" and "fail" lies.

A replica that fails before the client got a byte (connection refused or reset, a 5xx, the body cut
short) raises ReplicaFailed: nothing reached the client, so the proxy may send the request to another
replica. Once a streamed answer has started, a retry would splice two different samples into one answer,
so a failure then ends the stream with an error event instead, and the caller learns why.
"""

from __future__ import annotations

import contextlib
import json

import aiohttp
from aiohttp import web

# Generations have no overall time limit (long completions, paused replicas); a dead host still fails fast.
DATA_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10)
# Says which replica produced an answer the proxy passed on (answers without it are the proxy's own).
REPLICA_HEADER = "X-Proxy-Replica"
# What a replica failure looks like from the data path's side.
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, ConnectionError)


class ReplicaFailed(Exception):
    """The replica failed before the client received anything. `answer` is the replica's own 5xx reply
    (None when it gave none), to pass on when the proxy decides not to retry."""

    def __init__(self, replica_id: str, reason: str, answer: web.Response | None = None):
        super().__init__(f"replica {replica_id}: {reason}")
        self.replica_id = replica_id
        self.answer = answer


async def forward(
    request: web.Request, session: aiohttp.ClientSession, replica_id: str, url: str, payload: bytes
) -> tuple[web.StreamResponse, str | None]:
    """Send `payload` to the replica at `url` and pass its answer on; streams chunk by chunk.

    Returns the response and, when the replica failed in the middle of a stream, why (the stream was
    ended with an error event). Raises ReplicaFailed when the client has received nothing yet.
    """
    headers = {"Content-Type": "application/json"}
    request_id = request.headers.get("X-Request-Id", "")
    # Passed on only when it is a plain token: anything else could not be sent, or would reach vLLM's logs.
    if request_id and len(request_id) <= 256 and request_id.isascii() and request_id.isprintable():
        headers["X-Request-Id"] = request_id
    try:
        upstream = await session.post(url + request.path, data=payload, headers=headers)
    except UPSTREAM_ERRORS as e:
        raise ReplicaFailed(replica_id, f"{type(e).__name__}: {e}") from e
    # Leaving this block (normally, on error, or cancelled by a client that hung up) closes an unfinished
    # upstream connection, which makes vLLM abort the request instead of computing it for nobody.
    async with upstream:
        content_type = upstream.headers.get("Content-Type", "application/json")
        passed_on = {"Content-Type": content_type, REPLICA_HEADER: replica_id}
        if not content_type.startswith("text/event-stream"):
            try:
                body = await upstream.read()
            except UPSTREAM_ERRORS as e:
                raise ReplicaFailed(replica_id, f"answer cut short: {type(e).__name__}: {e}") from e
            answer = web.Response(status=upstream.status, body=body, headers=passed_on)
            if upstream.status >= 500:
                raise ReplicaFailed(replica_id, f"HTTP {upstream.status}", answer)
            return answer, None

        # Server-sent events: headers go out with the first chunk, so a replica that dies before its
        # first token can still be replaced.
        response = web.StreamResponse(
            status=upstream.status, headers={**passed_on, "Cache-Control": "no-cache"}
        )
        while True:
            try:
                chunk = await upstream.content.readany()
            except UPSTREAM_ERRORS as e:
                reason = f"stream cut short: {type(e).__name__}: {e}"
                if not response.prepared:
                    raise ReplicaFailed(replica_id, reason) from e
                await _end_with_error(response, replica_id, reason)
                return response, reason
            if not response.prepared:
                await response.prepare(request)
            if not chunk:
                break
            await response.write(chunk)
        await response.write_eof()
        return response, None


async def _end_with_error(response: web.StreamResponse, replica_id: str, reason: str) -> None:
    """End a started stream with an OpenAI-style error event (the openai client raises APIError on it)
    and no [DONE], so no client mistakes a cut-off answer for a finished one."""
    error = {"message": f"replica {replica_id} failed mid-stream: {reason}", "type": "BadGatewayError",
             "param": None, "code": 502}  # fmt: skip
    with contextlib.suppress(ConnectionError, aiohttp.ClientError):  # the client may be gone too
        await response.write(f"data: {json.dumps({'error': error})}\n\n".encode())
        await response.write_eof()
