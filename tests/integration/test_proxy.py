"""The proxy in front of two real vLLM CPU servers, driven by TRL's VLLMClient and the openai client.

Each test starts its own proxy (milliseconds) over the session's two servers, uses adapter names of its
own and unloads what it loads, resumes what it pauses. TRL's VLLMClient is synchronous (requests), so it
runs in a thread: calling it on the event loop would block the proxy it talks to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import uuid
from pathlib import Path

import aiohttp
import pytest

from rl_cluster.config import ProxyConfig
from rl_cluster.errors import AdapterNotFound
from rl_cluster.proxy.adapter_loader import HttpAdapterLoader
from rl_cluster.proxy.server import ProxyServer

pytestmark = pytest.mark.vllm

REPLICA_IDS = ("r0", "r1")


async def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """The proxy's /metrics read with prometheus_client's parser: (sample, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A rank-1 PEFT LoRA on every linear layer of the tiny model, lora_B non-zero so it changes outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("adapter") / "lora"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rejected_adapter_dir(adapter_dir, tmp_path_factory) -> Path:
    """An adapter the servers refuse: its rank is above their --max-lora-rank."""
    out = tmp_path_factory.mktemp("bad-adapter") / "lora"
    shutil.copytree(adapter_dir, out)
    config = json.loads((out / "adapter_config.json").read_text())
    config["r"] = 64
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture
async def start_proxy(vllm_servers):
    """Factory: a started proxy over the servers named in `replicas`; `controls` replaces a replica's
    AdapterLoader."""
    started: list[ProxyServer] = []

    async def start(
        controls: dict | None = None, replicas=REPLICA_IDS, max_model_len: int | None = None, **config
    ) -> tuple[ProxyServer, str]:
        proxy = ProxyServer(ProxyConfig(**config), max_model_len=max_model_len)
        url = await proxy.start()
        started.append(proxy)
        for replica_id, server in zip(REPLICA_IDS, vllm_servers, strict=True):
            if replica_id in replicas:
                await proxy.add_replica(replica_id, server.url, (controls or {}).get(replica_id))
        return proxy, url

    yield start
    for proxy in started:
        # Whatever a failed test left loaded goes, so the shared servers stay clean for the next one.
        for replica in proxy.stats()["replicas"].values():
            for name in replica["adapters_loaded"]:
                with contextlib.suppress(AdapterNotFound):
                    await HttpAdapterLoader(replica["url"]).unload_adapter(name)
        await proxy.stop()  # resumes replicas a failed test left paused


def trl_client(url: str):
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # VLLMClient logs through accelerate, which needs its state (the trainer makes one)
    return VLLMClient(url, server_timeout=30)


def openai_client(url: str):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def post_json(url: str, payload: dict | bytes, headers: dict | None = None) -> tuple[int, dict | str]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as session, session.post(url, data=data, headers=headers) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def replica_models(server) -> set[str]:
    async with aiohttp.ClientSession() as session, session.get(f"{server.url}/v1/models") as r:
        return {m["id"] for m in (await r.json())["data"]}


def trl_completion(model: str, prompt_ids: list[int], seed: int) -> dict:
    """The payload TRL's rollout worker sends (`_generate_one_turn`)."""
    return {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": 8,
        "temperature": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": seed,
    }


async def test_trl_vllm_client_against_proxy(start_proxy, vllm_servers, adapter_dir):
    proxy, url = await start_proxy()
    client = trl_client(url)
    await asyncio.to_thread(client.wait_for_server_ready)
    assert await asyncio.to_thread(client.get_max_model_len) == 256
    info = await asyncio.to_thread(client.get_server_info)
    assert info["lora_config"] is not None and info["parallel_config"]["data_parallel_size"] == 1
    assert await asyncio.to_thread(client.get_dtype) == "torch.float32"

    # The sync sequence of AsyncGRPOTrainer._sync_weight: pause, load, resume (then later unload).
    name = unique("trl-policy-v1")
    await asyncio.to_thread(client.pause)
    await asyncio.to_thread(client.load_lora_adapter, name, str(adapter_dir))
    await asyncio.to_thread(client.resume)
    assert proxy.stats()["adapters_routable"] == [name]
    for replica in replica_stats(proxy):
        assert replica["adapters_loaded"] == [name]

    openai = openai_client(url)
    out = await openai.completions.create(model=name, prompt="3+4", max_tokens=4, temperature=0)
    assert out.model == name and out.choices[0].text is not None
    # A second load of the same name from the same path is a retry (the client never got the answer):
    # done already. From another path it is refused like vLLM refuses it: names are never reused.
    await asyncio.to_thread(client.load_lora_adapter, name, str(adapter_dir))
    with pytest.raises(Exception, match="already been loaded"):
        await asyncio.to_thread(client.load_lora_adapter, name, str(adapter_dir.parent))

    await asyncio.to_thread(client.unload_lora_adapter, name)
    await wait_until(lambda: not any(r["adapters_loaded"] for r in replica_stats(proxy)))
    for server in vllm_servers:
        assert name not in await replica_models(server)
    status, body = await post_json(f"{url}/v1/completions", {"model": name, "prompt": "1+1", "max_tokens": 2})
    assert status == 404 and body["error"]["type"] == "NotFoundError"


async def test_pause_does_not_block_control_calls(start_proxy, tiny_model_dir):
    """Paused generations pile up on the data path; /resume (control path) must still get through."""
    proxy, url = await start_proxy()
    client = trl_client(url)
    await asyncio.to_thread(client.pause)
    try:
        payload = {"model": str(tiny_model_dir), "prompt": "2+2", "max_tokens": 4}
        pending = [asyncio.create_task(post_json(f"{url}/v1/completions", payload)) for _ in range(24)]
        done, _ = await asyncio.wait(pending, timeout=1.5)
        assert not done, "generations finished while the replicas were paused"
        assert sum(r["in_flight"] for r in replica_stats(proxy)) == 24
        # Control calls still answer while 24 generations hang.
        assert await asyncio.to_thread(client.get_max_model_len) == 256
    finally:
        await asyncio.to_thread(client.resume)
    results = await asyncio.wait_for(asyncio.gather(*pending), timeout=60)
    assert all(status == 200 for status, _ in results)
    assert not proxy.stats()["paused"]


async def test_pause_lease_expires(start_proxy, tiny_model_dir, caplog):
    proxy, url = await start_proxy(pause_lease_s=1.0)
    status, _ = await post_json(f"{url}/pause?mode=keep", {})
    assert status == 200 and proxy.stats()["paused"]
    payload = {"model": str(tiny_model_dir), "prompt": "5+1", "max_tokens": 2}
    # Nobody resumes: the proxy does it itself after the lease, and the request completes.
    status, _ = await asyncio.wait_for(post_json(f"{url}/v1/completions", payload), timeout=30)
    assert status == 200
    # The replica can finish 2 tokens before its answer to the proxy's /resume arrives (CI saw this):
    # the proxy's flag drops when every replica has answered, moments later.
    await wait_until(lambda: not proxy.stats()["paused"], timeout=10)
    assert "pause_lease_s" in caplog.text


async def test_openai_client_through_proxy(start_proxy, tiny_model_dir):
    _, url = await start_proxy()
    openai = openai_client(url)
    model = str(tiny_model_dir)

    out = await openai.completions.create(model=model, prompt="3+4=", max_tokens=6, n=3, temperature=1.0)
    assert len(out.choices) == 3

    chat = await openai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "2+5"}], max_tokens=4
    )
    assert chat.choices[0].message.role == "assistant"

    stream = await openai.completions.create(
        model=model, prompt="1+1", max_tokens=12, logprobs=1, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [chunk async for chunk in stream]
    # Server-sent events passed through, ending where the 12 tokens ran out. How many events vLLM sends is
    # its own (on a loaded machine all 12 tokens came in one: CI's run of this stop): that events pass as
    # they come, before the stream is over, is test_proxy_failover's mid-stream kill. Tokens are counted
    # by their logprobs, not their text: end-of-text tokens (ignore_eos) decode to nothing, and CI's run of
    # stop 28 had all 12 of them so.
    assert len(chunks) >= 1
    assert chunks[-1].choices[0].finish_reason == "length"
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 12, tokens

    chat_stream = await openai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "9+0"}], max_tokens=6, stream=True
    )
    assert len([c async for c in chat_stream]) >= 2

    # TRL's own request shape: token ids in, token ids and logprobs out.
    status, body = await post_json(f"{url}/v1/completions", trl_completion(model, [1, 40, 41, 42], seed=7))
    assert status == 200
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0


async def test_group_lands_on_one_replica(start_proxy, tiny_model_dir):
    # The guard must allow a whole group (G samples) on one replica; with a smaller threshold a group sent
    # at once spills after threshold + 1 samples (checked at the end).
    group_size = 8
    groups = ([1, 20, 21, 22, 23], [1, 30, 31, 32, 33, 34])
    proxy, url = await start_proxy(imbalance_threshold=group_size)
    model = str(tiny_model_dir)
    before = {r: s["requests"] for r, s in proxy.stats()["replicas"].items()}
    for group_prompt in groups:
        results = await asyncio.gather(
            *(
                post_json(f"{url}/v1/completions", trl_completion(model, group_prompt, seed=i))
                for i in range(group_size)
            )
        )
        assert all(status == 200 for status, _ in results)
        after = {r: s["requests"] for r, s in proxy.stats()["replicas"].items()}
        # The whole group went to one replica, whichever it was.
        assert sorted(after[r] - before[r] for r in after) == [0, group_size], after
        before = after
    routing = proxy.stats()["routing"]
    # Only a group's first sample can find its prefix nowhere; every later one follows it (affinity), and
    # none spills while the group fits under the threshold: affinity share >= (G - 1) / G.
    assert sum(routing.values()) == len(groups) * group_size, routing
    assert routing["spill"] == 0, routing
    assert routing["affinity"] >= len(groups) * (group_size - 1), routing

    spilling, url2 = await start_proxy(imbalance_threshold=2)
    await asyncio.gather(
        *(post_json(f"{url2}/v1/completions", trl_completion(model, [1, 50, 51], seed=i)) for i in range(8))
    )
    assert spilling.stats()["routing"]["spill"] > 0

    # Each replica's capacity (vLLM's max_num_seqs) is learnt from its /server_info in the background.
    await wait_until(lambda: all(r["capacity"] for r in proxy.stats()["replicas"].values()))
    metrics = await scrape(url)
    # /metrics shows the same numbers as stats().
    for reason, count in proxy.stats()["routing"].items():
        assert metrics[("rl_proxy_route_total", (("reason", reason),))] == count
    for replica_id, replica in proxy.stats()["replicas"].items():
        assert metrics[("rl_proxy_requests_total", (("replica", replica_id),))] == replica["requests"]
        assert metrics[("rl_proxy_capacity", (("replica", replica_id),))] == replica["capacity"] >= 1


class RedirectPath:
    """An AdapterLoader that gives its replica a different adapter path (a broken or late bucket view)."""

    def __init__(self, inner: HttpAdapterLoader, path: str):
        self.inner, self.path = inner, path
        self.load_calls = 0

    async def load_adapter(self, name: str, path: str) -> None:
        self.load_calls += 1
        await self.inner.load_adapter(name, self.path)

    async def unload_adapter(self, name: str) -> None:
        await self.inner.unload_adapter(name)


async def test_failed_load_is_rolled_back(start_proxy, vllm_servers, adapter_dir, rejected_adapter_dir):
    bad = RedirectPath(HttpAdapterLoader(vllm_servers[1].url), str(rejected_adapter_dir))
    proxy, url = await start_proxy(controls={"r1": bad})
    name = unique("rollback")
    status, body = await post_json(
        f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)}
    )
    assert status == 400, body
    assert "replica r1" in body["error"]["message"] and "rolled back on r0" in body["error"]["message"]
    assert set(body["replicas"]) == {"r1"}
    assert bad.load_calls == 1  # a rejection is not retried
    assert name not in await replica_models(vllm_servers[0]) | await replica_models(vllm_servers[1])
    assert proxy.stats()["adapters_routable"] == []
    # The name is free again: once the bucket is right, the same name loads.
    bad.path = str(adapter_dir)
    status, _ = await post_json(
        f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)}
    )
    assert status == 200
    status, _ = await post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": name})
    assert status == 200


async def test_load_retries_not_found_until_deadline(start_proxy, vllm_servers, adapter_dir, tmp_path):
    proxy, url = await start_proxy(load_retry_interval_s=0.2, load_deadline_s=20)
    # A lagging mount: the path appears a moment after the load was asked for.
    late = tmp_path / "late-adapter"
    name = unique("late")
    loop = asyncio.get_running_loop()
    loop.call_later(0.7, shutil.copytree, adapter_dir, late)
    status, body = await post_json(f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(late)})
    assert status == 200, body
    assert proxy.stats()["adapters_routable"] == [name]
    await post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": name})

    # A path that never appears: "not found" until the deadline, then 404, nothing left loaded.
    proxy2, url2 = await start_proxy(load_retry_interval_s=0.1, load_deadline_s=0.5)
    status, body = await post_json(
        f"{url2}/v1/load_lora_adapter", {"lora_name": unique("never"), "lora_path": str(tmp_path / "nope")}
    )
    assert status == 404 and "AdapterNotFound" in body["error"]["message"], body
    assert proxy2.stats()["adapters_routable"] == []


async def test_a_load_that_reached_the_replica_already_counts_as_loaded(vllm_servers, adapter_dir):
    """vllm_compat item 5: vLLM refuses a second load of a name it holds (400), which a load that arrived
    late (sent across a partition, given up on, sent again by the catch-up) meets; the loader takes it as
    loaded, since a name never stands for other weights."""
    server, name = vllm_servers[0], unique("twice")
    loader = HttpAdapterLoader(server.url)
    await loader.load_adapter(name, str(adapter_dir))
    try:
        status, body = await post_json(
            f"{server.url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)}
        )
        assert status == 400 and "has already been loaded" in json.dumps(body), (status, body)  # vLLM's own
        await loader.load_adapter(name, str(adapter_dir))  # the loader's: done
        assert name in await replica_models(server)
    finally:
        await loader.unload_adapter(name)


async def test_unload_waits_for_in_flight(start_proxy, vllm_servers, adapter_dir):
    proxy, url = await start_proxy()
    name = unique("drain")
    status, _ = await post_json(
        f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)}
    )
    assert status == 200
    await post_json(f"{url}/pause?mode=keep", {})
    try:
        running = asyncio.create_task(
            post_json(f"{url}/v1/completions", {"model": name, "prompt": "4+4", "max_tokens": 3})
        )
        await wait_until(lambda: sum(r["in_flight"] for r in replica_stats(proxy)) == 1)
        status, _ = await post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": name})
        assert status == 200
        # Closed to new requests at once, but the replica serving the running one keeps it loaded.
        status, body = await post_json(
            f"{url}/v1/completions", {"model": name, "prompt": "1+2", "max_tokens": 2}
        )
        assert status == 404
        await wait_until(lambda: sorted(len(r["adapters_loaded"]) for r in replica_stats(proxy)) == [0, 1])
    finally:
        await post_json(f"{url}/resume", {})
    status, _ = await running
    assert status == 200
    await wait_until(lambda: not any(r["adapters_loaded"] for r in replica_stats(proxy)))
    assert all(name in r["adapters_ever_loaded"] for r in replica_stats(proxy))


async def test_joining_replica_catches_up(start_proxy, vllm_servers, adapter_dir):
    proxy, url = await start_proxy(replicas=("r0",))
    name = unique("catch-up")
    status, _ = await post_json(
        f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)}
    )
    assert status == 200
    await proxy.add_replica("r1", vllm_servers[1].url)  # loads every live version before taking traffic
    assert name in await replica_models(vllm_servers[1])
    assert [r["adapters_loaded"] for r in replica_stats(proxy)] == [[name], [name]]
    results = await asyncio.gather(
        *(
            post_json(f"{url}/v1/completions", {"model": name, "prompt": f"{i}+1", "max_tokens": 2})
            for i in range(4)
        )
    )
    assert all(status == 200 for status, _ in results)
    assert all(r["requests"] > 0 for r in replica_stats(proxy))  # unrelated prompts spread over both

    await proxy.remove_replica("r1")
    assert list(proxy.stats()["replicas"]) == ["r0"]
    await post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": name})
    await wait_until(lambda: not replica_stats(proxy)[0]["adapters_loaded"])
    # r1 left the proxy with the adapter still loaded: clean it up directly.
    await HttpAdapterLoader(vllm_servers[1].url).unload_adapter(name)
    assert (await scrape(url))[("rl_proxy_broadcast_seconds_count", (("op", "load"),))] == 1


async def test_request_errors(start_proxy, vllm_servers, tiny_model_dir):
    _, url = await start_proxy(max_body_bytes=2000)
    # An unknown model: the same answer a vLLM server gives.
    payload = {"model": "no-such-adapter", "prompt": "1+1", "max_tokens": 2}
    status, body = await post_json(f"{url}/v1/completions", payload)
    direct_status, direct = await post_json(f"{vllm_servers[0].url}/v1/completions", payload)
    assert status == direct_status == 404
    # Same shape and wording; vLLM may redact the model path in the alias list (it does under /tmp).
    assert {k: v for k, v in body["error"].items() if k != "message"} == {
        k: v for k, v in direct["error"].items() if k != "message"
    }
    assert (
        body["error"]["message"].split("Valid aliases")[0]
        == direct["error"]["message"].split("Valid aliases")[0]
    )

    status, body = await post_json(f"{url}/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = await post_json(f"{url}/v1/completions", b"[1, 2]")
    assert status == 400
    status, body = await post_json(f"{url}/v1/completions", {"prompt": "x" * 5000})
    assert status == 413
    status, body = await post_json(f"{url}/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400
    status, body = await post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": unique("never-loaded")})
    assert status == 404
    # No model field: the base model.
    status, _ = await post_json(f"{url}/v1/completions", {"prompt": "1+1", "max_tokens": 2})
    assert status == 200


async def test_max_sequences_and_context_bound_requests(start_proxy, vllm_servers, tiny_model_dir):
    """Over-limit requests get the proxy's 400 before any replica sees them (the context refusals are the
    ones vLLM itself gives, so the proxy only answers sooner); a normal request still works after."""
    context = vllm_servers[0].spec.max_model_len
    proxy, url = await start_proxy(max_n=4, max_sequences_per_request=8, max_model_len=context)
    model = str(tiny_model_dir)
    too_many = {"model": model, "prompt": [[1, 20], [1, 21], [1, 22]], "n": 3, "max_tokens": 2}
    status, body = await post_json(f"{url}/v1/completions", too_many)
    assert status == 400, body
    assert body["error"]["message"] == (
        "the request asks for 9 sequences (3 prompts x n=3); at most 8 per request (proxy.max_sequences_per_request)"
    )
    assert body["error"]["type"] == "BadRequestError" and body["error"]["param"] == "prompt"
    for over_context, needle in (
        ({"prompt": "1+1", "max_tokens": context + 1}, f"cannot be greater than max_model_len={context}"),
        ({"prompt": [1] * context, "max_tokens": 1}, "no room for a completion"),
    ):
        payload = {"model": model, **over_context}
        status, body = await post_json(f"{url}/v1/completions", payload)
        assert status == 400 and needle in body["error"]["message"], body
        direct_status, direct = await post_json(f"{vllm_servers[0].url}/v1/completions", payload)
        assert direct_status == 400, direct  # vLLM refuses it too: the proxy only answers sooner
    assert sum(r["requests"] for r in replica_stats(proxy)) == 0

    # At the limit, and a long prompt whose max_tokens vLLM caps at what the context leaves: both served.
    status, body = await post_json(
        f"{url}/v1/completions", {**too_many, "prompt": [[1, 20], [1, 21]], "n": 4}
    )
    assert status == 200 and len(body["choices"]) == 8, body
    status, body = await post_json(
        f"{url}/v1/completions", {"model": model, "prompt": [1] * (context - 2), "max_tokens": 8}
    )
    assert status == 200 and body["usage"]["completion_tokens"] <= 2, body


async def test_a_token_guards_every_route_but_health_and_metrics(start_proxy, tiny_model_dir):
    _, url = await start_proxy(auth_token="s3cret")
    right, wrong = {"Authorization": "Bearer s3cret"}, {"Authorization": "Bearer s3cretx"}
    for path in ("/pause", "/resume", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        status, body = await post_json(f"{url}{path}", {})
        assert status == 401, path
    # Generation spends the replicas: without the token it never reaches one.
    completion = {"model": str(tiny_model_dir), "prompt": "1+2", "max_tokens": 2}
    chat = {"model": str(tiny_model_dir), "messages": [{"role": "user", "content": "1+2"}], "max_tokens": 2}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        for headers in (None, wrong):
            status, answer = await post_json(f"{url}{path}", body, headers)
            assert status == 401 and answer["error"]["type"] == "UnauthorizedError", (path, answer)
        status, answer = await post_json(f"{url}{path}", body, right)
        assert status == 200 and answer["choices"], (path, answer)
    async with aiohttp.ClientSession() as session:
        for path in ("/replicas", "/v1/models", "/server_info"):  # what the replicas serve, and how
            async with session.get(f"{url}{path}") as r:
                assert r.status == 401, path
            async with session.get(f"{url}{path}", headers=right) as r:
                assert r.status == 200, path
        async with session.get(f"{url}/replicas", headers=right) as r:
            assert set((await r.json())["replicas"]) == set(REPLICA_IDS)
        for path in ("/health", "/metrics"):  # probes and scrapers stay open
            async with session.get(f"{url}{path}") as r:
                assert r.status == 200, path
    # TRL's client sends no token (compat item 19); the authorized one reads the server's config.
    from requests import HTTPError

    from rl_cluster.trainer.compat import AuthorizedVLLMClient

    with pytest.raises(HTTPError, match="401"):
        await asyncio.to_thread(trl_client(url).get_server_info)
    info = await asyncio.to_thread(AuthorizedVLLMClient(url, auth_token="s3cret").get_server_info)
    assert info["parallel_config"]["data_parallel_size"] == 1 and info["lora_config"]["max_loras"] >= 1
    assert await asyncio.to_thread(AuthorizedVLLMClient(url, auth_token="s3cret").get_max_model_len) > 0


async def test_http_control_maps_vllm_answers(vllm_servers, tmp_path):
    control = HttpAdapterLoader(vllm_servers[0].url)
    with pytest.raises(AdapterNotFound):
        await control.load_adapter(unique("missing"), str(tmp_path / "missing"))
    with pytest.raises(AdapterNotFound):
        await control.unload_adapter(unique("missing"))


def replica_stats(proxy: ProxyServer) -> list[dict]:
    return list(proxy.stats()["replicas"].values())


async def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if predicate():
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.05)


async def test_with_no_replica_requests_wait_for_one_then_give_up_with_a_reason(
    start_proxy, vllm_servers, tiny_model_dir
):
    """Every replica down (restarting): a generation request waits, and is answered once a replica is
    back; with none back within proxy.unavailable_timeout_s, generation and loads get a 503 that says why."""
    proxy, url = await start_proxy(replicas=(), unavailable_timeout_s=2.0)
    request = {"model": str(tiny_model_dir), "prompt": "1+1=", "max_tokens": 2}
    status, body = await post_json(f"{url}/v1/completions", request)
    assert status == 503 and "no generator replica has been active for 2 s" in body["error"]["message"], body
    status, body = await post_json(
        f"{url}/v1/load_lora_adapter", {"lora_name": unique("x"), "lora_path": "/nope"}
    )
    assert status == 503 and "proxy.unavailable_timeout_s" in body["error"]["message"], body

    waiting = asyncio.ensure_future(post_json(f"{url}/v1/completions", request))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # held, not refused
    await proxy.add_replica("r0", vllm_servers[0].url)
    status, body = await asyncio.wait_for(waiting, 60)
    assert status == 200 and body["choices"], body
