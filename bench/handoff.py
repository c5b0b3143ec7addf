"""Handoff: how long from `publish_adapter` until a new version is routable on every replica, for a
directory bucket and an s3:// bucket (moto's S3 server on loopback), beside a direct load of the same
adapter into one vLLM server (no bucket, no proxy) measured in the same run.

The path measured is the real one minus Ray's actor hop: the proxy broadcasts the load, and each
replica's control first fetches and verifies the version (Bucket.fetch_verified, what GeneratorActor
does) into a cache of its own, then POSTs /v1/load_lora_adapter to its vLLM server. The verify step is
also timed on its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path

import aiohttp

from bench.common import HTTP_TIMEOUT, median, quantile
from loopback import S3_ENV, moto_s3
from rl_cluster.bucket import Bucket
from rl_cluster.config import ProxyConfig
from rl_cluster.core.manifest import AdapterMeta
from rl_cluster.models import model_fingerprint
from rl_cluster.proxy.adapter_loader import HttpAdapterLoader
from rl_cluster.proxy.server import ProxyServer

S3_BUCKET = "bench-handoff"
MAX_LORA_RANK = 8  # ServerSpec's default --max-lora-rank


class VerifyingControl:
    """The replica side of a load as GeneratorActor does it: fetch + verify, then load into vLLM."""

    def __init__(self, bucket: Bucket, url: str, cache_dir: Path, fingerprint: str):
        self.bucket, self.cache_dir, self.fingerprint = bucket, cache_dir, fingerprint
        self.http = HttpAdapterLoader(url)

    async def load_adapter(self, name: str, path: str) -> None:
        local = await asyncio.to_thread(
            self.bucket.fetch_verified,
            path,
            cache_dir=self.cache_dir,
            base_fingerprint=self.fingerprint,
            max_lora_rank=MAX_LORA_RANK,
        )
        await self.http.load_adapter(name, str(local))

    async def unload_adapter(self, name: str) -> None:
        await self.http.unload_adapter(name)


def make_adapter(model_dir: Path, out: Path) -> Path:
    """A rank-1 PEFT LoRA on every linear layer of the tiny model (what the trainer publishes)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear"))
    model.save_pretrained(out)
    return out


async def post(session: aiohttp.ClientSession, url: str, payload: dict) -> None:
    async with session.post(url, json=payload) as r:
        if r.status != 200:
            raise RuntimeError(f"POST {url} {payload}: HTTP {r.status}: {(await r.text())[:300]}")


async def through_proxy(bucket: Bucket, servers, adapter: Path, fingerprint: str, versions: int, work: Path):
    """Publish `versions` versions, each loaded through the proxy on every replica; per-version timings."""
    run, name = f"bench-{uuid.uuid4().hex[:6]}", "handoff"
    proxy = ProxyServer(ProxyConfig())
    url = await proxy.start()
    timings = []
    try:
        for i, server in enumerate(servers):
            control = VerifyingControl(bucket, server.url, work / f"cache-r{i}", fingerprint)
            await proxy.add_replica(f"r{i}", server.url, control)
        async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
            # Version 1 is a warm-up (first load on a server, first S3 connection) and is not reported.
            for version in range(1, versions + 2):
                t0 = time.perf_counter()
                uri = await asyncio.to_thread(
                    bucket.publish_adapter, run, name, version, adapter,
                    AdapterMeta(base_model="tiny", base_fingerprint=fingerprint, rank=1, alpha=2.0,
                                target_modules="all-linear", trainer_step=version),
                )  # fmt: skip
                t1 = time.perf_counter()
                await asyncio.to_thread(
                    bucket.fetch_verified, uri, cache_dir=work / "cache-probe",
                    base_fingerprint=fingerprint, max_lora_rank=MAX_LORA_RANK,
                )  # fmt: skip
                t2 = time.perf_counter()
                await post(
                    session,
                    f"{url}/v1/load_lora_adapter",
                    {"lora_name": f"{run}-v{version}", "lora_path": uri},
                )
                t3 = time.perf_counter()
                timings.append({"publish_s": t1 - t0, "verify_s": t2 - t1, "load_s": t3 - t2})
                timings[-1]["routable_s"] = timings[-1]["publish_s"] + timings[-1]["load_s"]
                if version > 1:  # keep the servers' adapter slots free, as the trainer does
                    await post(
                        session, f"{url}/v1/unload_lora_adapter", {"lora_name": f"{run}-v{version - 1}"}
                    )
            await post(session, f"{url}/v1/unload_lora_adapter", {"lora_name": f"{run}-v{versions + 1}"})
            await asyncio.sleep(0.5)  # the proxy unloads in the background
    finally:
        await proxy.stop()
    return timings[1:]


async def direct(server_url: str, adapter: Path, versions: int) -> list[float]:
    """The same adapter loaded straight into one vLLM server under new names: vLLM's own cost."""
    control = HttpAdapterLoader(server_url)
    seconds = []
    for version in range(versions + 1):  # version 0: warm-up, not reported
        name = f"direct-{uuid.uuid4().hex[:6]}-v{version}"
        t0 = time.perf_counter()
        await control.load_adapter(name, str(adapter))
        seconds.append(time.perf_counter() - t0)
        await control.unload_adapter(name)
    return seconds[1:]


def summarize(values: list[float]) -> dict:
    return {"p50_ms": 1000 * median(values), "p95_ms": 1000 * quantile(values, 0.95), "n": len(values)}


def qwen25_1p5b_bytes() -> dict:
    """Qwen2.5-1.5B from its config (no download): full bf16 weights against a rank-1 LoRA on
    q, k, v, o, gate, up, down of every layer (lora_A r x in + lora_B out x r per module)."""
    hidden, layers, inter, heads, kv_heads, vocab = 1536, 28, 8960, 12, 2, 151936
    head_dim = hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = [
        (hidden, q),
        (hidden, kv),
        (hidden, kv),
        (q, hidden),
        (hidden, inter),
        (hidden, inter),
        (inter, hidden),
    ]
    lora_params = layers * sum(i + o for i, o in shapes)  # rank 1
    per_layer = sum(i * o for i, o in shapes) + q + 2 * kv + 2 * hidden  # weights, q/k/v biases, 2 norms
    full_params = layers * per_layer + vocab * hidden + hidden  # tied embeddings, final norm
    return {
        "full_params": full_params,
        "full_bytes_bf16": 2 * full_params,
        "lora_params": lora_params,
        "lora_bytes_fp32": 4 * lora_params,
        "lora_bytes_bf16": 2 * lora_params,
    }


def tiny_bytes(model_dir: Path, adapter: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return {
        "full_bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors")),
        "lora_bytes": (adapter / "adapter_model.safetensors").stat().st_size,
        "dtype": config.get("dtype") or config.get("torch_dtype"),
    }


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    work = log_dir / "handoff"
    adapter = await asyncio.to_thread(make_adapter, model_dir, work / "adapter")
    fingerprint = model_fingerprint(model_dir)
    versions = plan.handoff_versions
    results = {
        "direct vLLM load (one server, no bucket, no proxy)": {
            "load_s": await direct(servers[0].url, adapter, versions)
        }
    }
    directory = Bucket(str(work / "bucket"))
    results["directory bucket, proxy, 2 replicas"] = _columns(
        await through_proxy(directory, servers, adapter, fingerprint, versions, work / "dir")
    )
    for key, value in S3_ENV.items():  # for s3fs, in this process
        os.environ.setdefault(key, value)
    with moto_s3(S3_BUCKET, log_dir / "moto.log") as endpoint:
        s3 = Bucket(f"s3://{S3_BUCKET}/runs", endpoint)
        results["s3 bucket (moto, loopback), proxy, 2 replicas"] = _columns(
            await through_proxy(s3, servers, adapter, fingerprint, versions, work / "s3")
        )
    rows = []
    for label, columns in results.items():
        rows.append({"path": label, **{k: summarize(v) for k, v in columns.items()}})
    return {
        "rows": rows,
        "versions": versions,
        "bytes": {"tiny": tiny_bytes(model_dir, adapter), "qwen25_1p5b": qwen25_1p5b_bytes()},
    }


def _columns(timings: list[dict]) -> dict[str, list[float]]:
    return {key: [t[key] for t in timings] for key in timings[0]}
