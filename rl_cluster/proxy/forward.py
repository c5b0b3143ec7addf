"""One attempt at a generation on one replica, and where the line between "retry" and "fail" lies.

A replica that fails before the client got a byte (connection refused or reset, a 5xx, the body cut
short, a 200 whose JSON does not parse) raises ReplicaFailed: nothing reached the client, so the proxy may
send the request to another replica. Once a streamed answer has started, a retry would splice two
different samples into one answer, so a failure then ends the stream with an error event instead, and the
caller learns why. A stream is bounded too: an honest one has at most one event per token of each
sequence and a few more, so a replica that streams past that (forever, say) is cut off there.
"""

from __future__ import annotations

import contextlib
import json

import aiohttp
import msgspec
from aiohttp import web

from rl_cluster.proxy.validation import DEFAULT_CONTEXT_TOKENS

# The slowest pace at which a replica still counts as working: seconds per generated token.
SLOWEST_TOKEN_S = 1.0


def data_timeout(pause_lease_s: float, max_model_len: int | None, read_timeout_s: float | None = None):
    """The data path's timeout: no overall limit (long completions), a dead host fails fast (connect),
    and a replica that sends nothing for `read_timeout_s` is hung. Unset, that is derived from the
    config: a paused replica holds requests for up to `pause_lease_s`, and the longest completion the
    context allows (`max_model_len` tokens) comes at no slower than SLOWEST_TOKEN_S per token."""
    if read_timeout_s is None:
        read_timeout_s = pause_lease_s + (max_model_len or DEFAULT_CONTEXT_TOKENS) * SLOWEST_TOKEN_S
    return aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout_s)


# Says which replica produced an answer the proxy passed on (answers without it are the proxy's own).
REPLICA_HEADER = "X-Proxy-Replica"
# What a replica failure looks like from the data path's side.
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, ConnectionError)


class ReplicaFailed(Exception):
    """The replica failed before the client received anything. `answer` is the replica's own 5xx reply
    (None when it gave none), to pass on when the proxy decides not to retry."""

    def __init__(
        self,
        replica_id: str,
        reason: str,
        answer: web.Response | None = None,
        timed_out: bool = False,
        misbehaved: bool = False,
    ):
        super().__init__(f"replica {replica_id}: {reason}")
        self.replica_id = replica_id
        self.answer = answer
        self.timed_out = timed_out  # it missed the read deadline: hung, treated as down without a probe
        self.misbehaved = misbehaved  # its answer broke the protocol: out of routing without a probe

    @property
    def cause(self) -> str:
        """How it failed, one of rl_cluster.proxy.metrics.RETRY_CAUSES: no answer (refused, reset, cut short),
        none in time, a 5xx, or an answer that broke the protocol."""
        if self.misbehaved:
            return "protocol"
        if self.timed_out:
            return "timeout"
        return "connection" if self.answer is None else "error_answer"


# Checks that a body is one JSON value without building it (msgspec scans it in C).
_check_json = msgspec.json.Decoder(msgspec.Raw).decode


async def forward(
    request: web.Request,
    session: aiohttp.ClientSession,
    replica_id: str,
    url: str,
    payload: bytes,
    max_events: int | None = None,
) -> tuple[web.StreamResponse, ReplicaFailed | None]:
    """Send `payload` to the replica at `url` and pass its answer on; streams chunk by chunk, at most
    `max_events` server-sent events (None: unbounded).

    Returns the response and, when the replica failed in the middle of a stream, how (the stream was
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
        raise ReplicaFailed(replica_id, _reason(e), timed_out=isinstance(e, TimeoutError)) from e
    # Leaving this block (normally, on error, or cancelled by a client that hung up) closes an unfinished
    # upstream connection, which makes vLLM abort the request instead of computing it for nobody.
    async with upstream:
        content_type = upstream.headers.get("Content-Type", "application/json")
        passed_on = {"Content-Type": content_type, REPLICA_HEADER: replica_id}
        if content_type.startswith("text/event-stream"):
            return await _pass_stream(request, upstream, replica_id, passed_on, max_events)
        return await _pass_body(upstream, replica_id, passed_on), None


async def _pass_body(upstream: aiohttp.ClientResponse, replica_id: str, passed_on: dict) -> web.Response:
    """A whole answer, read before anything goes out: a failure is still the proxy's to retry."""
    try:
        body = await upstream.read()
    except UPSTREAM_ERRORS as e:
        reason = f"answer cut short: {_reason(e)}"
        raise ReplicaFailed(replica_id, reason, timed_out=isinstance(e, TimeoutError)) from e
    answer = web.Response(status=upstream.status, body=body, headers=passed_on)
    if upstream.status >= 500:
        raise ReplicaFailed(replica_id, f"HTTP {upstream.status}", answer)
    if upstream.status == 200 and passed_on["Content-Type"].startswith("application/json"):
        try:
            _check_json(body)
        except msgspec.DecodeError as e:
            reason = f"answered malformed JSON (HTTP 200, {len(body)} bytes: {e})"
            raise ReplicaFailed(replica_id, reason, misbehaved=True) from None
    return answer


async def _pass_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    replica_id: str,
    passed_on: dict,
    max_events: int | None,
) -> tuple[web.StreamResponse, ReplicaFailed | None]:
    """Server-sent events, chunk by chunk. Headers go out with the first chunk, so a replica that dies
    before its first token can still be replaced."""
    response = web.StreamResponse(status=upstream.status, headers={**passed_on, "Cache-Control": "no-cache"})
    events = 0
    while True:
        try:
            chunk = await upstream.content.readany()
        except UPSTREAM_ERRORS as e:
            reason = f"stream cut short: {_reason(e)}"
            timed_out = isinstance(e, TimeoutError)
            if not response.prepared:
                raise ReplicaFailed(replica_id, reason, timed_out=timed_out) from e
            await _end_with_error(response, replica_id, reason)
            return response, ReplicaFailed(replica_id, reason, timed_out=timed_out)
        if not response.prepared:
            await response.prepare(request)
        if not chunk:
            break
        # An event ends with a blank line; one split across two chunks may be missed, which the bound's
        # slack covers.
        events += chunk.count(b"\n\n")
        if max_events is not None and events > max_events:
            reason = f"streamed more than {max_events} events, more than the request's tokens allow"
            await _end_with_error(response, replica_id, reason)
            return response, ReplicaFailed(replica_id, reason, misbehaved=True)
        await response.write(chunk)
    await response.write_eof()
    return response, None


def _reason(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return f"no data within the read deadline ({type(error).__name__})"
    return f"{type(error).__name__}: {error}"


async def _end_with_error(response: web.StreamResponse, replica_id: str, reason: str) -> None:
    """End a started stream with an OpenAI-style error event (the openai client raises APIError on it)
    and no [DONE], so no client mistakes a cut-off answer for a finished one."""
    error = {"message": f"replica {replica_id} failed mid-stream: {reason}", "type": "BadGatewayError",
             "param": None, "code": 502}  # fmt: skip
    with contextlib.suppress(ConnectionError, aiohttp.ClientError):  # the client may be gone too
        await response.write(f"data: {json.dumps({'error': error})}\n\n".encode())
        await response.write_eof()
