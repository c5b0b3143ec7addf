"""Start, watch and stop one vLLM OpenAI server process.

A vLLM server is a process tree (API server, engine core, workers, resource tracker). We start it in
its own process group so one signal reaches the whole tree, and we start a detached watchdog
(`rl_cluster.generator.watchdog`) that ends the group when the owning process disappears: Ray kills a
dead actor's process group, but not a group we created, and neither `atexit` nor a parent-death
signal survives every way a job ends (Ctrl-C of a local driver, `ray.kill`, `ray job stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from rl_cluster.config import RunConfig
from rl_cluster.generator.vllm_compat import API_KEY_ENV, SERVER_MODULE, cpu_engine_args
from rl_cluster.nodes import stable_port


@dataclass(frozen=True)
class ServerSpec:
    """Everything that decides how one vLLM server is launched."""

    model: str
    port: int
    host: str = "127.0.0.1"
    dtype: str = "float32"
    max_model_len: int = 256
    max_loras: int = 6
    max_lora_rank: int = 8
    logprobs_mode: str = "processed_logprobs"
    enable_prefix_caching: bool = True
    kv_cache_gb: int = 1
    cpu_cores: tuple[int, ...] = ()
    """CPU build: the cores its engine's workers are bound to, one per tensor-parallel rank; (): unbound."""
    tensor_parallel_size: int = 1
    log_level: str = "INFO"
    """vLLM's log level (VLLM_LOGGING_LEVEL), set whatever the starter's environment says (vllm_compat item 6)."""
    use_gpu: bool = False
    gpu_memory_utilization: float = 0.9
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    served_model_name: str | None = None
    """The base model's name in the API (`--served-model-name`); None: the path. A run names it after
    `model.path`, so replicas on nodes whose caches lie at different paths still agree."""
    api_key: str | None = field(default=None, repr=False)
    """The run's replica key: every route but /health then needs `Authorization: Bearer <key>`. Passed
    in the environment, not on the command line (vLLM logs its arguments; `ps` shows them)."""

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", SERVER_MODULE,
            "--model", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--enable-lora",
            "--max-loras", str(self.max_loras),
            "--max-lora-rank", str(self.max_lora_rank),
            "--logprobs-mode", self.logprobs_mode,
            "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching",
        ]  # fmt: skip
        if self.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.use_gpu:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        else:
            cmd += cpu_engine_args(self.max_model_len)  # seeded long prompts crash a chunked prefill
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.api_key:
            cmd += ["--middleware", "rl_cluster.generator.vllm_compat.RequireApiKey"]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_SERVER_DEV_MODE="1",  # /pause, /resume, /server_info
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",  # /v1/load_lora_adapter, /v1/unload_lora_adapter
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gb),
            # vLLM logs to stdout, a file here: written line by line, not when 8 KB are full or at a clean
            # exit (a server stopped with SIGKILL, or that never exits cleanly, took its lines with it).
            PYTHONUNBUFFERED="1",
            VLLM_LOGGING_LEVEL=self.log_level,  # not TRL's ERROR, inherited from whoever imported TRL
        )
        if self.cpu_cores:  # vLLM's CPU build: one core list per tensor-parallel rank, separated by "|"
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, self.cpu_cores))
        env.pop(API_KEY_ENV, None)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        return env


def server_spec(
    config: RunConfig, model_dir: str, cores: tuple[int, ...], host: str, api_key: str
) -> ServerSpec:
    """The vLLM server one replica runs: the run's model and generator settings, on a free port of `host`,
    its workers bound to `cores` on a CPU (one per tensor-parallel rank: rl_cluster.generator.cores; ()
    leaves them unbound)."""
    g, model = config.generator, config.model
    use_gpu = g.num_gpus > 0
    return ServerSpec(
        model=model_dir,
        port=stable_port(host),
        host=host,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        max_loras=g.max_loras,
        max_lora_rank=g.max_lora_rank,
        logprobs_mode=g.logprobs_mode,
        enable_prefix_caching=g.enable_prefix_caching,
        kv_cache_gb=g.kv_cache_gb,
        cpu_cores=() if use_gpu else cores,
        tensor_parallel_size=g.tensor_parallel_size,
        log_level=g.log_level,
        use_gpu=use_gpu,
        gpu_memory_utilization=g.gpu_memory_utilization,
        extra_args=tuple(g.extra_args),
        served_model_name=model.path,
        api_key=api_key,
    )


class VLLMServer:
    """One supervised vLLM server process (group)."""

    def __init__(self, spec: ServerSpec, log_path: str | Path):
        self.spec = spec
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.spec.command(),
                env=self.spec.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: one killpg reaches the whole tree
            )
        # `setsid --fork`: the watchdog runs in its own session AND is not our child (the intermediate
        # process exits at once). Ray kills a dead worker's child processes, whatever their session; a
        # watchdog that is our child dies with us and the vLLM engine core is left running.
        subprocess.run(
            ["setsid", "--fork", sys.executable, "-m", "rl_cluster.generator.watchdog",
             str(os.getpid()), str(self.process.pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
        )  # fmt: skip

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def wait_healthy(self, timeout_s: float) -> float:
        """Wait until GET /health answers 200; return the seconds it took. Fails early if the process dies."""
        start = time.monotonic()
        async with aiohttp.ClientSession() as session:
            while True:
                if self.process is None or self.process.poll() is not None:
                    code = None if self.process is None else self.process.returncode
                    raise RuntimeError(
                        f"vLLM server on port {self.spec.port} exited (code {code}) before it was healthy. "
                        f"Last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    async with session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200:
                            return time.monotonic() - start
                except (aiohttp.ClientError, TimeoutError):
                    pass
                if time.monotonic() - start > timeout_s:
                    raise TimeoutError(
                        f"vLLM server on port {self.spec.port} not healthy after {timeout_s:.0f}s; raise "
                        f"generator.startup_timeout_s if the model is large. Last lines of {self.log_path}:\n"
                        f"{self.log_tail()}"
                    )
                await asyncio.sleep(1.0)

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the whole process group; SIGKILL whatever is left after `grace_s`."""
        if self.process is None:
            return
        terminate_group(self.process.pid, grace_s)
        self.process.wait()
        self.process = None


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def terminate_group(pgid: int, grace_s: float) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        # Reap our direct child if it is ours, else it stays a zombie and the group looks alive.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pgid, os.WNOHANG)
        if not group_alive(pgid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
