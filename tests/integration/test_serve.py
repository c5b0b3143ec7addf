"""`jobs/serve.py` as a subprocess: a private local Ray cluster, one vLLM generator behind the proxy, an
OpenAI-client completion through it, then SIGINT, and nothing it started outlives it."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import free_port, vllm_pids_with

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


def lines_of(stream) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def wait_for_line(lines: queue.Queue, prefix: str, timeout: float, seen: list[str]) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line.rstrip("\n")
    raise AssertionError(f"no line starting with {prefix!r}; output:\n{''.join(seen)[-6000:]}")


def test_serve_until_sigint(tmp_path):
    marker = f"RL_CLUSTER_SERVE_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    env.pop("RAY_ADDRESS", None)
    # A Ray temp dir of its own (short: Ray's socket paths have a length limit), and cluster.address=local: the job
    # starts a cluster of its own instead of joining one someone else runs on this machine.
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rls", dir="/tmp")
    port = free_port()
    command = [
        sys.executable, "jobs/serve.py", "--config", "jobs/configs/cpu_demo.toml",
        "generator.replicas=1", f"bucket.uri={tmp_path / 'bucket'}", "--port", str(port), "cluster.address=local",
        f"run_name=serve-test-{uuid.uuid4().hex[:6]}",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen: list[str] = []
    try:
        lines = lines_of(proc.stdout)
        line = wait_for_line(lines, "proxy listening on ", 300, seen)
        assert line == f"proxy listening on http://127.0.0.1:{port}"
        assert vllm_pids_with(marker), "the job's vLLM server is not running (or not recognisable)"

        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="1+2", max_tokens=4, temperature=0)
        assert out.choices[0].text is not None and out.usage.completion_tokens >= 1

        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, "".join(seen)[-6000:]
        print(f"serve stopped {time.monotonic() - started:.1f}s after SIGINT")
        deadline = time.monotonic() + 30  # watchdogs end anything a graceful stop missed within seconds
        while vllm_pids_with(marker) and time.monotonic() < deadline:
            time.sleep(1)
        assert not vllm_pids_with(marker)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
