"""1,000+ malformed and hostile requests against the proxy in front of two real vLLM CPU servers.

What must hold: the proxy never answers a 5xx of its own making (its own answers carry no
X-Proxy-Replica header, so a 5xx passed through from a replica is told apart; and since the proxy
validates what it understands before forwarding, none is expected at all for those fields); nothing
gets loaded or paused; afterwards it is healthy and still serves a good request.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import pytest

from rl_cluster.config import ProxyConfig
from rl_cluster.proxy.forward import REPLICA_HEADER
from rl_cluster.proxy.server import ProxyServer

pytestmark = pytest.mark.vllm

TOKEN = "fuzz-token"
MAX_BODY = 64 * 1024
SEED = 1234
ANSWER_WITHIN_S = 180  # a hang, not a slow machine: each answers in well under a second here
HOSTILE_VALUES = [
    None, -1, 0, 1, 2**31, 2**63, 10**30, -(10**30), 1.5, -0.5, "", "x", "1", "💥" * 50, "\u0000", "\u202e",
    [], {}, [[]], [None], [-5], [1, "a"], {"a": [1]}, True, False, [True], "\t\n", "A" * 5000,
]  # fmt: skip
CONTROL_PATHS = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/pause", "/resume", "/replicas"]
KNOWN_PATHS = ["/v1/completions", "/v1/chat/completions", "/health", "/v1/models", "/server_info", "/metrics"]
GUARDED_PATHS = [*CONTROL_PATHS, "/v1/completions", "/v1/chat/completions", "/v1/models", "/server_info"]


@dataclass
class Case:
    kind: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict = field(default_factory=dict)
    raw: bytes | None = None  # sent on a bare socket: HTTP that a client library would refuse to write


def completion(rng: random.Random, base_model: str) -> dict:
    return {"model": base_model, "prompt": rng.choice(["1+1", "2+3=", [1, 20, 21]]), "max_tokens": 2}


def chat(rng: random.Random, base_model: str) -> dict:
    return {"model": base_model, "messages": [{"role": "user", "content": "2+2"}], "max_tokens": 2}


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=rng_choice_ascii()).encode("utf-8", "surrogatepass")


_ascii_flip = random.Random(SEED + 1)


def rng_choice_ascii() -> bool:
    return _ascii_flip.random() < 0.5


def make_cases(rng: random.Random, base_model: str, bucket: str) -> list[Case]:
    gen = "/v1/completions"
    chat_path = "/v1/chat/completions"
    json_headers = {"Content-Type": "application/json"}
    auth = {**json_headers, "Authorization": f"Bearer {TOKEN}"}
    cases: list[Case] = []

    def add(kind, method, path, body=None, headers=None, raw=None):
        # The proxy holds a token: every case carries it but those about credentials.
        cases.append(Case(kind, method, path, body, headers if headers is not None else auth, raw))

    # Bodies that are not JSON objects, or JSON only a lax parser accepts.
    valid = dumps(completion(rng, base_model))
    for _ in range(120):
        choice = rng.randrange(8)
        if choice == 0:
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        elif choice == 1:
            body = valid[: rng.randrange(len(valid))]
        elif choice == 2:
            body = rng.choice([b"[]", b"null", b"1", b'"s"', b"true", b"[1,2]", b"{}{}", b"\xef\xbb\xbf{}"])
        elif choice == 3:
            body = rng.choice([b'{"prompt": "x", "max_tokens": NaN}', b'{"temperature": Infinity, "prompt": "x"}',
                               b'{"prompt": "x", "n": -Infinity}'])  # fmt: skip
        elif choice == 4:
            depth = rng.choice([40, 1000, 100_000])
            body = b'{"prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
        elif choice == 5:
            body = b'{"prompt": "\\ud800\\udfff\\ud800", "max_tokens": 2}'
        elif choice == 6:
            body = '{"prompt": "\u00e9\u4e2d"}'.encode("latin-1", "replace") + b"\xc3\x28"
        else:
            body = b""
        add("bad-json", "POST", rng.choice([gen, chat_path]), body)

    # Known fields with wrong types or out-of-range values.
    for _ in range(300):
        route = rng.choice([gen, chat_path])
        body = completion(rng, base_model) if route == gen else chat(rng, base_model)
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n",
                               "temperature", "stream"])  # fmt: skip
            body[name] = rng.choice(HOSTILE_VALUES)
        if rng.random() < 0.3:
            body.pop(rng.choice(["prompt", "messages", "model"]), None)  # missing fields
        add("bad-field", "POST", route, dumps(body))

    # Hostile chat structures.
    for _ in range(60):
        message = rng.choice([{"role": rng.choice(HOSTILE_VALUES)}, {"content": "x"}, "user", [{"role": "user"}],
                              {"role": "user", "content": rng.choice(HOSTILE_VALUES)}])  # fmt: skip
        add(
            "bad-chat",
            "POST",
            chat_path,
            dumps({"model": base_model, "messages": [message], "max_tokens": 2}),
        )

    # Well-typed requests with unicode garbage and extra fields: these reach vLLM.
    for _ in range(80):
        text = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0xD7FF), rng.randrange(0xE000, 0x10FFFF)]))
                       for _ in range(rng.randrange(1, 40)))  # fmt: skip
        body = {"model": base_model, "prompt": text, "max_tokens": rng.randint(1, 4), "n": rng.randint(1, 3),
                "temperature": rng.choice([0, 0.5, 2.0]), "unknown_" + str(rng.randrange(99)): rng.choice(HOSTILE_VALUES),
                "stream": rng.random() < 0.3}  # fmt: skip
        add("unicode", "POST", gen, dumps(body))
    for _ in range(20):
        body = {"model": rng.choice(["no-such-model", "../../etc/passwd", "💥", " " * 3, "a" * 3000]), "prompt": "1",
                "max_tokens": 1}  # fmt: skip
        add("unknown-model", "POST", rng.choice([gen, chat_path]), dumps(body))

    # Unknown routes and path traversal in the URL.
    traversal = ["/../../etc/passwd", "/v1/../../etc/passwd", "/v1/%2e%2e/%2e%2e/etc/passwd", "/%00", "/v1//completions",
                 "/v1/completions/../../health", "/v2/completions", "/v1/completions/x", "/" + "a" * 7000, "/ü/💥",
                 "/v1/models/../../../../root", "/metrics/%ff"]  # fmt: skip
    for _ in range(100):
        path = rng.choice(traversal) if rng.random() < 0.5 else "/" + "/".join(
            rng.choice(["v1", "..", "admin", "lora", "%2f", "x" * rng.randrange(1, 20)]) for _ in range(rng.randint(1, 4))
        )  # fmt: skip
        add("unknown-route", rng.choice(["GET", "POST", "DELETE"]), path, valid)

    # Wrong methods on known routes.
    for _ in range(60):
        path = rng.choice(KNOWN_PATHS + CONTROL_PATHS)
        add(
            "wrong-method",
            rng.choice(["GET", "PUT", "DELETE", "PATCH", "POST", "OPTIONS"]),
            path,
            valid,
            auth,
        )

    # Oversized bodies, with and without a truthful length.
    for _ in range(30):
        size = rng.choice([MAX_BODY + 1, MAX_BODY * 2, MAX_BODY * 8])
        body = b'{"prompt": "' + b"x" * size + b'"}'
        add("oversized", "POST", rng.choice([gen, chat_path, "/v1/load_lora_adapter"]), body, auth)

    # Adapter loads outside the bucket (and junk inside it), with the right token.
    escapes = ["../../etc", "/etc", "/etc/passwd", f"{bucket}/../outside", f"{bucket}/escape", f"{bucket}/escape/x",
               f"{bucket}/etc-link", "relative/adapter", "s3://other-bucket/x", "~/adapter", f"{bucket}/\x00x",
               "file:///etc", f"{bucket}" + "/.." * 20 + "/etc"]  # fmt: skip
    for _ in range(100):
        body = {"lora_name": f"fuzz-{rng.randrange(10**6)}", "lora_path": rng.choice(escapes)}
        if rng.random() < 0.3:
            body[rng.choice(["lora_name", "lora_path"])] = rng.choice(HOSTILE_VALUES)
        if rng.random() < 0.1:
            body["load_inplace"] = True
        add("adapter-path", "POST", "/v1/load_lora_adapter", dumps(body), auth)
    for junk in ("missing", "empty", "bad-config"):  # inside the bucket: these reach the replicas
        add("adapter-junk", "POST", "/v1/load_lora_adapter",
            dumps({"lora_name": f"junk-{junk}-{rng.randrange(10**6)}", "lora_path": f"{bucket}/{junk}"}), auth)  # fmt: skip
    for _ in range(40):
        body = {"lora_name": rng.choice(HOSTILE_VALUES)} if rng.random() < 0.7 else {"name": "x"}
        add("unload", "POST", "/v1/unload_lora_adapter", dumps(body), auth)

    # /pause with parameters vLLM does not take (never a valid pause: that would freeze the servers).
    for _ in range(40):
        query = rng.choice(["mode=later", "mode=", "mode=keep&evil=1", "clear_cache=perhaps", "mode=%00",
                            "mode=keep&mode=abort&x=y", "a=" + "b" * 500, "mode=💥"])  # fmt: skip
        add("pause-query", "POST", f"/pause?{query}", b"", auth)

    # Garbage credentials on every guarded route: control, generation, info.
    for _ in range(100):
        token = rng.choice(["", "Bearer", "Bearer ", f"Bearer {TOKEN}x", f"bearer {TOKEN}", "Basic Zm9vOmJhcg==",
                            "Bearer " + "A" * 4000, f"Bearer  {TOKEN}", TOKEN, "Bearer \t"])  # fmt: skip
        path = rng.choice(GUARDED_PATHS)
        add(
            "auth",
            "GET" if path in ("/replicas", "/v1/models", "/server_info") else "POST",
            path,
            valid if path in (gen, chat_path) else b"{}",
            {**json_headers, "Authorization": token},
        )
    for _ in range(20):
        garbage = bytes(rng.choice([0xFF, 0xC3, 0x80, 0xE2, 0x28, 0x41]) for _ in range(rng.randrange(1, 30)))
        path = rng.choice(GUARDED_PATHS).encode()
        raw = (
            b"POST "
            + path
            + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + garbage
            + b"\r\nContent-Length: 2\r\n\r\n{}"
        )
        add("auth-raw", "POST", path.decode(), raw=raw)

    # Garbage headers on generations (one is forwarded: X-Request-Id).
    for _ in range(30):
        headers = {"Content-Type": rng.choice(["application/json", "text/plain", "", "multipart/form-data; boundary=x"]),
                   "X-Request-Id": rng.choice(["", "a" * 3000, "\t", "id-1", "ü"]), "Authorization": f"Bearer {TOKEN}"}  # fmt: skip
        add("headers", "POST", gen, dumps(completion(rng, base_model)), headers)
    for _ in range(20):
        request_id = bytes(
            rng.choice([0xFF, 0xE2, 0x80, 0x41, 0x7F, 0x01]) for _ in range(rng.randrange(1, 20))
        )
        body = dumps(completion(rng, base_model))
        raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
               + TOKEN.encode() + b"\r\nX-Request-Id: "
               + request_id + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
        add("headers-raw", "POST", "/v1/completions", raw=raw)

    # Broken HTTP framing.
    broken = [b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
              b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n{}",
              b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
              b"GET / HTTP/9.9\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
              b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", b"POST /v1/completions HTTP/1.1\r\nNo colon here\r\n\r\n",
              b"POST /v1/completions HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}"]  # fmt: skip
    for _ in range(30):
        add("framing", "RAW", "-", raw=rng.choice(broken))
    return cases


async def send(session: aiohttp.ClientSession, url: str, case: Case) -> tuple[int, str | None]:
    """(status, replica header); status 0 when the proxy closed the connection without an answer."""
    if case.raw is not None:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(case.raw)
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), timeout=15)
        except (ConnectionError, TimeoutError):
            line = b""  # a half-sent request the server waits on, or a closed connection: no answer
        finally:
            writer.close()
        parts = line.split()
        return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), None
    async with session.request(
        case.method, url + case.path, data=case.body, headers=case.headers, skip_auto_headers=["Content-Type"]
    ) as response:
        await response.read()
        return response.status, response.headers.get(REPLICA_HEADER)


@pytest.fixture
def fuzz_bucket(tmp_path):
    bucket = tmp_path / "bucket"
    (bucket / "empty").mkdir(parents=True)
    (bucket / "bad-config").mkdir()
    (bucket / "bad-config" / "adapter_config.json").write_text("{not json")
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", bucket / "escape")
    os.symlink("/etc", bucket / "etc-link")
    return bucket


async def test_fuzz(vllm_servers, tiny_model_dir, fuzz_bucket):
    # load_deadline_s bounds each replica's answer to a load too: long enough for a real one to answer
    # (one that does not is down), short enough that a missing adapter's retries end soon.
    proxy = ProxyServer(
        ProxyConfig(auth_token=TOKEN, max_body_bytes=MAX_BODY, max_n=8, load_deadline_s=3.0, load_retry_interval_s=0.1),
        adapter_root=str(fuzz_bucket),
    )  # fmt: skip
    url = await proxy.start()
    try:
        for i, server in enumerate(vllm_servers):
            await proxy.add_replica(f"r{i}", server.url)
        cases = make_cases(random.Random(SEED), str(tiny_model_dir), str(fuzz_bucket))
        random.Random(SEED).shuffle(cases)
        assert len(cases) >= 1000

        start = time.monotonic()
        limit = asyncio.Semaphore(16)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one(case: Case):
                # A bound per request, so that a hang names its request (CI's slowest machine saw a bare
                # TimeoutError of the whole session's 60 s total, with no case to look at).
                async with limit:
                    try:
                        return case, *await asyncio.wait_for(send(session, url, case), ANSWER_WITHIN_S)
                    except TimeoutError:
                        return case, -1, None

            results = await asyncio.gather(*(one(c) for c in cases))
        elapsed = time.monotonic() - start
        unanswered = [
            (c.kind, c.method, c.path[:80], (c.body or c.raw or b"")[:200]) for c, s, _ in results if s == -1
        ]
        assert not unanswered, f"no answer within {ANSWER_WITHIN_S} s: {unanswered[:10]}"

        own_5xx = [
            (c.kind, c.method, c.path[:80], (c.body or c.raw or b"")[:200], s)
            for c, s, r in results
            if s >= 500 and r is None
        ]
        passed_5xx = [
            (c.kind, c.path, (c.body or b"")[:200], s, r) for c, s, r in results if s >= 500 and r is not None
        ]
        by_kind = Counter((c.kind, s) for c, s, _ in results)
        print(f"{len(cases)} fuzz requests in {elapsed:.1f}s: {sorted(by_kind.items())}")
        assert not own_5xx, own_5xx[:10]
        assert not passed_5xx, passed_5xx[:10]  # validation keeps malformed input away from vLLM
        # Most hostile input is refused by the proxy itself; well-formed garbage was served.
        assert sum(n for (kind, s), n in by_kind.items() if kind == "bad-field" and s == 400) > 200
        assert sum(n for (kind, s), n in by_kind.items() if kind == "unicode" and s == 200) > 0
        assert all(
            s in (400, 401)
            for (kind, s) in by_kind
            if kind in ("adapter-path", "auth", "auth-raw", "pause-query")
        )

        # Afterwards: nothing loaded or paused, both replicas active, and a good request is served.
        stats = proxy.stats()
        assert stats["adapters_routable"] == [] and not stats["paused"]
        assert [r["state"] for r in stats["replicas"].values()] == ["active", "active"]
        assert all(r["adapters_loaded"] == [] for r in stats["replicas"].values())
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/health") as r:
                assert r.status == 200
            payload = {"model": str(tiny_model_dir), "prompt": "1+2", "max_tokens": 3}
            async with session.post(
                f"{url}/v1/completions", json=payload, headers={"Authorization": f"Bearer {TOKEN}"}
            ) as r:
                assert r.status == 200 and (await r.json())["choices"][0]["text"] is not None
    finally:
        await proxy.stop()
