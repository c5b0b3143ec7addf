"""The trainer's HTTP client against a stub server on loopback: the token it sends, what it retries under
each caller's choice, and what it leaves to the caller."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler

import pytest
import requests
from conftest import http_stub

from rl_cluster.core.retry import RetriesExhausted, RetryPolicy
from rl_cluster.trainer.http import HttpClient, describe, no_answer, unreachable

NO_WAIT = RetryPolicy(attempts=3, first_delay_s=0.0)


class _Stub(BaseHTTPRequestHandler):
    statuses: list[int] = []  # answered in turn; 200 once they run out
    seen: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        status = type(self).statuses.pop(0) if type(self).statuses else 200
        payload = json.dumps({"ok": status == 200} if status == 200 else {"error": f"E{status}"}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    _Stub.statuses, _Stub.seen = [], []
    with http_stub(_Stub) as url:
        yield f"{url}/"


def test_the_token_goes_with_every_call_and_the_answer_comes_back_as_json(stub):
    assert HttpClient(stub, "s3cret").post("/v1/completions", {"n": 1}) == {"ok": True}
    assert _Stub.seen == [{"path": "/v1/completions", "auth": "Bearer s3cret", "n": 1}]
    HttpClient(stub).post("/x", {})
    assert _Stub.seen[-1]["auth"] is None  # no token, no header


def test_a_5xx_is_retried_when_the_caller_says_so(stub):
    _Stub.statuses = [503, 500]
    assert HttpClient(stub, retry=NO_WAIT, retryable=no_answer).post("/x", {}) == {"ok": True}
    assert len(_Stub.seen) == 3


def test_a_5xx_is_an_answer_for_a_caller_that_retries_only_an_unreachable_server(stub):
    _Stub.statuses = [502]
    with pytest.raises(requests.HTTPError) as caught:
        HttpClient(stub, retry=NO_WAIT, retryable=unreachable).post("/x", {})
    assert len(_Stub.seen) == 1 and describe(caught.value) == 'HTTP 502: {"error": "E502"}'


def test_a_4xx_is_never_retried(stub):
    _Stub.statuses = [400, 400]
    with pytest.raises(requests.HTTPError):
        HttpClient(stub, retry=NO_WAIT, retryable=no_answer).post("/x", {})
    assert len(_Stub.seen) == 1


def test_a_server_that_never_answers_exhausts_the_retries():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RetriesExhausted) as caught:
        HttpClient(f"http://127.0.0.1:{port}", retry=NO_WAIT).post("/x", {})
    assert caught.value.attempts == 3 and isinstance(caught.value.last, requests.ConnectionError)
    with pytest.raises(requests.ConnectionError):  # no policy: one try, the error as it came
        HttpClient(f"http://127.0.0.1:{port}").post("/x", {})


def test_the_proxy_client_turns_a_refusal_and_an_outage_into_proxy_control_errors(stub):
    from rl_cluster.trainer.proxy_client import ProxyClient, ProxyControlError

    _Stub.statuses = [502]
    with pytest.raises(ProxyControlError, match='HTTP 502: {"error": "E502"}'):
        ProxyClient(stub, "t").load_adapter("run-v2", "/bucket/run-v2")
    assert _Stub.seen == [{"path": "/v1/load_lora_adapter", "auth": "Bearer t", "lora_name": "run-v2",
                           "lora_path": "/bucket/run-v2"}]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # reconnect_s shorter than the first wait (1 s): one try, then the error that names the outage
    with pytest.raises(ProxyControlError, match=r"unreachable for 0 s \(/v1/unload_lora_adapter\)"):
        ProxyClient(f"http://127.0.0.1:{port}", reconnect_s=0.5).unload_adapter("run-v2")


def test_the_proxy_client_follows_its_address_between_tries(stub):
    """The proxy's node was lost: its old address answers nothing, and rank 0 moves the ProxyAddress
    when the proxy's actor says where Ray restarted it. A call under way goes there from its next try;
    the trainer's followers hear each move once."""
    from rl_cluster.trainer.proxy_client import ProxyAddress, ProxyClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        lost = f"http://127.0.0.1:{s.getsockname()[1]}"
    address, heard = ProxyAddress(lost), []
    address.followers.append(heard.append)
    client = ProxyClient(address, "t", reconnect_s=30)
    _Stub.statuses = [200]
    mover = threading.Timer(0.3, address.move, args=(stub,))  # during the first wait (1 s)
    mover.start()
    try:
        client.unload_adapter("run-v2")
    finally:
        mover.cancel()
    assert _Stub.seen == [{"path": "/v1/unload_lora_adapter", "auth": "Bearer t", "lora_name": "run-v2"}]
    moved = stub.rstrip("/")
    assert client.url == moved and heard == [moved]
    assert not address.move(moved)  # where it is already: no news for the followers
    assert heard == [moved]


class _NoModel:
    """What the served-vs-trained check touches of a model when no replica gave it samples."""

    training = True

    def __init__(self):
        self.config = type("Config", (), {"_attn_implementation": "packed"})()

    def eval(self):
        self.training = False

    def train(self, mode: bool = True):
        self.training = mode

    def set_attn_implementation(self, name: str):
        self.config._attn_implementation = name


def test_the_served_vs_trained_check_skips_a_replica_that_died_but_not_one_that_refused(stub):
    """A replica listed as active whose engine died meanwhile answers 500 (vLLM's API server outlives its
    engine core for a moment), or nothing: the check goes on without it (the chaos run's sync died of
    that 500). One that answered 404 (no such adapter) is a real mismatch: that fails the sync."""
    import torch

    from rl_cluster.trainer.check import check_replicas

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there
    _Stub.statuses = [500]
    model = _NoModel()
    kw = {"samples": 2, "max_tokens": 4, "dtype": torch.float32, "noise_multiple": 4.0, "api_key": "k"}
    assert check_replicas(model, [stub.rstrip("/"), nobody], "r-v1", [1, 2], **kw) == []
    assert model.training and model.config._attn_implementation == "packed"  # left as it was
    _Stub.statuses = [404]
    with pytest.raises(requests.HTTPError, match="404"):
        check_replicas(model, [stub.rstrip("/")], "r-v1", [1, 2], **kw)
