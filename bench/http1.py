"""A minimal HTTP/1.1 message parser and response writer for bench.capacity's raw asyncio protocols (both
sides: the stub upstreams and the load generator), a few microseconds a message where aiohttp would cost
more than the router being measured."""

from __future__ import annotations


def take_message(buf: bytearray) -> tuple[str, dict[str, str], bytes, int] | None:
    """(first line, lower-cased headers, body, bytes used) of the first whole message in `buf`, or None
    while it is incomplete. Bodies by Content-Length or chunked; nothing else is needed here."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    start = end + 4
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body, pos = bytearray(), start
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
            if size == 0:
                if len(buf) < eol + 4:
                    return None
                return lines[0], headers, bytes(body), eol + 4
            if len(buf) < eol + 2 + size + 2:
                return None
            body += buf[eol + 2 : eol + 2 + size]
            pos = eol + 2 + size + 2
    length = int(headers.get("content-length", 0))
    if len(buf) < start + length:
        return None
    return lines[0], headers, bytes(buf[start : start + length]), start + length


def response(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    reason = {200: "OK", 404: "Not Found"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
