"""Replicas that lie, garble or never stop, beside a real vLLM CPU server, behind the real proxy.

A replica is another process on a shared network: it can answer 200 to an adapter load it did not do,
answer a generation with JSON that does not parse, or stream without end. Each hostile replica here is a
small aiohttp server on loopback that does one of those and is otherwise well (its /health answers 200,
its /v1/models names the real server's base model), so only the proxy's own checks can catch it. What
must hold: the client gets a real answer or one clear error, never the garbage; the hostile replica leaves
routing with a reason that names what it did; the real replica goes on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
from aiohttp import web
from conftest import free_port, save_lora

from rl_cluster.config import ProxyConfig
from rl_cluster.proxy.forward import REPLICA_HEADER
from rl_cluster.proxy.server import ProxyServer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile") / "lora"
    save_lora(tiny_model_dir, out, seed=3)
    return out


@contextlib.asynccontextmanager
async def hostile_replica(kind: str, base_model: str):
    """A replica that is well in every way but one: `kind` is "liar" (200 to every adapter load, loads
    nothing), "garbler" (200 with truncated JSON to every generation) or "endless" (streams one token
    event every 5 ms and never ends)."""

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": base_model, "object": "model"}]})

    async def ok(request):
        return web.Response()

    async def load(request):
        return web.Response(text="Success: LoRA adapter loaded.")  # what vLLM answers, without loading

    async def complete(request):
        body = await request.json()
        if kind != "endless" or not body.get("stream"):
            return web.Response(
                body=b'{"id": "cmpl-1", "choices": [{"text": "', content_type="application/json"
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while True:  # ends when the proxy hangs up
            event = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            await asyncio.sleep(0.005)

    app = web.Application()
    app.add_routes(
        [
            web.get("/health", ok),
            web.post("/pause", ok),  # the proxy resumes each replica it registers (vLLM's dev-mode routes)
            web.post("/resume", ok),
            web.get("/v1/models", models),
            web.post("/v1/load_lora_adapter", load),
            web.post("/v1/unload_lora_adapter", load),
            web.post("/v1/completions", complete),
        ]
    )
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def proxy_over(replicas: dict[str, str], **config):
    proxy = ProxyServer(ProxyConfig(health_interval_s=0.2, health_timeout_s=2, **config))
    url = await proxy.start()
    try:
        for replica_id, replica_url in replicas.items():
            await proxy.add_replica(replica_id, replica_url)
        yield proxy, url
    finally:
        await proxy.stop()


async def post(url: str, payload: dict) -> tuple[int, bytes, str | None]:
    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as response:
        return response.status, await response.read(), response.headers.get(REPLICA_HEADER)


OUT_OF_ROUTING = ("unhealthy", "catching_up")


def replica_state(proxy: ProxyServer, replica_id: str) -> tuple[str, str | None]:
    record = proxy.stats()["replicas"][replica_id]
    return record["state"], record["down_reason"]


async def test_a_replica_that_says_it_loaded_what_it_did_not_leaves_routing(vllm_servers, adapter):
    real = vllm_servers[0]
    base = (await served_base(real.url))[0]
    name = "hostile-liar-v1"
    async with (
        hostile_replica("liar", base) as liar_url,
        proxy_over({"r0": real.url, "liar": liar_url}) as (
            proxy,
            url,
        ),
    ):
        status, body, _ = await post(
            f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter)}
        )
        try:
            # The sync goes on with the replica that did load it; the liar is caught by /v1/models.
            assert status == 200, body
            # Health rounds (every 0.2 s) try to catch it up again, so it alternates between unhealthy
            # and catching_up; either way it is out of routing and the reason names the lie.
            state, reason = replica_state(proxy, "liar")
            assert state in OUT_OF_ROUTING and "does not list it" in reason, (state, reason)
            assert proxy.stats()["adapters_routable"] == [name]
            for i in range(8):
                status, answer, replica = await post(
                    f"{url}/v1/completions", {"model": name, "prompt": f"{i} + {i} =", "max_tokens": 3}
                )
                assert status == 200 and replica == "r0", answer
                assert json.loads(answer)["choices"][0]["text"] is not None
            # Its /health answers, so health rounds try to catch it up: each load is checked again, and it
            # stays out of routing.
            await asyncio.sleep(1.5)
            state, reason = replica_state(proxy, "liar")
            assert state in OUT_OF_ROUTING and "does not list it" in reason, (state, reason)
        finally:
            status, body, _ = await post(f"{url}/v1/unload_lora_adapter", {"lora_name": name})
            assert status == 200, body


async def test_malformed_json_from_a_replica_never_reaches_the_client(vllm_servers):
    real = vllm_servers[0]
    base = (await served_base(real.url))[0]
    request = {"model": base, "prompt": "1 + 1 =", "max_tokens": 2}
    async with hostile_replica("garbler", base) as garbler_url:
        # Alone, it leaves a clear 502 that names it and what it did, after a bounded wait for a replica.
        async with proxy_over({"garbler": garbler_url}, unavailable_timeout_s=2) as (proxy, url):
            status, answer, replica = await post(f"{url}/v1/completions", request)
            assert status == 502 and replica is None, answer
            message = json.loads(answer)["error"]["message"]
            assert "replica garbler" in message and "malformed JSON" in message, message
            assert "malformed JSON" in (replica_state(proxy, "garbler")[1] or "")
        # Beside a real replica, every answer is the real one's, whichever the proxy chose first.
        async with proxy_over({"garbler": garbler_url, "r0": real.url}) as (proxy, url):
            answers = await asyncio.gather(
                *(post(f"{url}/v1/completions", {**request, "prompt": f"{i} * 3 ="}) for i in range(16))
            )
            assert all(status == 200 and replica == "r0" for status, _, replica in answers), answers
            assert all(json.loads(answer)["choices"] for _, answer, _ in answers)
            chosen_first = proxy.stats()["retries"]
            assert chosen_first >= 1  # the garbler was active when the first requests were routed
            assert proxy.stats()["retried"] == {"garbler": {"protocol": chosen_first}}


async def test_a_stream_without_end_is_cut_off_at_what_the_request_allows(vllm_servers):
    base = (await served_base(vllm_servers[0].url))[0]
    async with (
        hostile_replica("endless", base) as endless_url,
        proxy_over({"endless": endless_url}) as (proxy, url),
        aiohttp.ClientSession() as session,
    ):
        started = time.monotonic()
        request = {"model": base, "prompt": "count:", "max_tokens": 4, "n": 2, "stream": True}
        async with asyncio.timeout(60), session.post(f"{url}/v1/completions", json=request) as response:
            assert response.status == 200
            text = (await response.read()).decode()
        events = [e for e in text.split("\n\n") if e]
        # At most the bound (2 sequences x (4 tokens + 4) + 8 = 24 events), then the proxy's error event.
        assert len(events) <= 25, len(events)
        assert "data: [DONE]" not in text
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert error["code"] == 502 and "streamed more than 24 events" in error["message"], error
        # It left routing (the pool learns of it as the stream ends); its /health answers, so a health
        # round may have let it back already: its reason stays.
        await asyncio.sleep(0.2)
        assert "streamed more than" in (replica_state(proxy, "endless")[1] or "")
        assert proxy.stats()["streams_broken"] == 1
        print(f"endless stream cut off after {len(events) - 1} events in {time.monotonic() - started:.2f} s")


async def served_base(url: str) -> list[str]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as response:
        return [m["id"] for m in (await response.json())["data"] if not m.get("parent")]


# -- served = trained: a replica that serves something else under the new name ----------------------------


def _variants(tiny_model_dir, root):
    """The adapter the trainer trained, and what a wrong replica might serve under its name: the base model
    (B = 0), an older version (B halved: the measured separation tells it apart in bf16 too), and the
    adapter on only some modules (the attention's, not the MLP's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    trained = root / "trained"
    save_lora(tiny_model_dir, trained, seed=3)
    weights = load_file(trained / "adapter_model.safetensors")
    variants = {
        "base": {k: v * 0 if "lora_B" in k else v for k, v in weights.items()},
        "older": {k: v * 0.5 if "lora_B" in k else v for k, v in weights.items()},
        "partial": {k: v * 0 if "lora_B" in k and ".mlp." in k else v for k, v in weights.items()},
    }
    for name, tensors in variants.items():
        shutil.copytree(trained, root / name)
        save_file(tensors, root / name / "adapter_model.safetensors")
    return trained, {name: root / name for name in variants}


@pytest.fixture(scope="module")
def bf16_server(tiny_model_dir, tmp_path_factory):
    """A real vLLM CPU server on the tiny model in bfloat16 (this machine's CPUs have avx512_bf16)."""
    from rl_cluster.generator.server import ServerSpec, VLLMServer

    server = VLLMServer(
        ServerSpec(model=str(tiny_model_dir), port=free_port(), dtype="bfloat16", cpu_cores=(0,)),
        tmp_path_factory.mktemp("vllm-bf16") / "vllm.log",
    )
    try:
        server.start()
        asyncio.run(server.wait_healthy(300))
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_replica_serving_the_base_model_an_older_version_or_part_of_the_adapter_fails_the_check(
    dtype, vllm_servers, bf16_server, tiny_model_dir, tmp_path
):
    """The served-vs-trained check on a real vLLM server: the trained adapter under the new name matches (bf16
    rounding is no mismatch); the base model, an older version or an adapter on only some modules, each
    under a new name of its own, is a mismatch, whose banner names what it looks like."""
    import requests
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_cluster.core.served_check import Verdict, mismatch_banner
    from rl_cluster.trainer.check import check_replicas, lora_state

    url = (vllm_servers[0] if dtype == "float32" else bf16_server).url
    trained, wrong = _variants(tiny_model_dir, tmp_path)
    served = {f"hostile-{dtype}-v9": trained} | {f"hostile-{dtype}-{n}-v9": p for n, p in wrong.items()}
    for name, path in served.items():
        answer = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                               timeout=60)  # fmt: skip
        assert answer.ok, answer.text
    torch_dtype = getattr(torch, dtype)

    def peft(path):
        return PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch_dtype), path
        )

    model, older = peft(trained), ("v5", lora_state(peft(wrong["older"])))
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir)("12+34=")["input_ids"]
    kw = {"samples": 4, "max_tokens": 16, "min_tokens": 64, "dtype": torch_dtype, "noise_multiple": 4.0,
          "older": older}  # fmt: skip
    verdicts = {}
    for name in served:
        try:
            (check,) = check_replicas(model, [url], name, prompt, **kw)
        finally:
            requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
        verdicts[name.removeprefix(f"hostile-{dtype}-").removesuffix("-v9")] = check
        print(
            f"{dtype} {name}: {check.verdict.value}, distance {check.distance:.2e}, floor {check.floor:.1e}"
        )
    assert verdicts["v9"].verdict is Verdict.MATCH, verdicts["v9"]
    assert all(verdicts[n].verdict is Verdict.MISMATCH for n in wrong), verdicts
    assert "It matches the base model" in mismatch_banner("r-v9", verdicts["base"], dtype)
    assert "It matches the v5" in mismatch_banner("r-v9", verdicts["older"], dtype)
    if dtype == "bfloat16":  # the rounding the check has to see past: far above fp32's 1e-7
        assert verdicts["v9"].gap > 1e-4 and verdicts["v9"].floor > 1e-4
