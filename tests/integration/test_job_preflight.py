"""On a real Ray cluster the driver refuses, in seconds and in one line, what would hang or vanish.

One plain `ray start --head` for the module, without the `trainer` / `generator` resources, as a user
starts one: the run must not wait for ever for a node that never comes (exit 2, naming the resource and
the `ray start` line that fixes it), and a `ray job submit --working-dir .` with a relative bucket.uri
must be refused before it writes into Ray's copy of the checkout. No vLLM starts, but the head takes
~30 s to start on 2 cores, hence the `vllm` marker (slow lane).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def _ours(temp_dir: str) -> list[int]:
    """Processes whose command line names the head's temp dir: this module's Ray, no one else's."""
    out = subprocess.run(["pgrep", "-f", temp_dir], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split() if int(pid) != os.getpid()]


@pytest.fixture(scope="module")
def plain_head():
    """A plain head (2 CPUs, no custom resources) with its own temp dir and ports: /tmp/ray untouched."""
    temp_dir = tempfile.mkdtemp(prefix="rlc-", dir="/tmp")  # short: Ray's socket paths have a length limit
    port, dashboard = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", "--block", "--num-cpus=2", "--node-ip-address=127.0.0.1",
         f"--port={port}", f"--dashboard-port={dashboard}", "--dashboard-host=127.0.0.1",
         "--include-dashboard=true", f"--dashboard-agent-listen-port={free_port()}",
         f"--ray-client-server-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while True:
            assert head.poll() is None, "ray start --head exited"
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/version", timeout=2)
                break
            assert time.monotonic() < deadline, "the head's dashboard did not answer"
            time.sleep(1)
        yield {"address": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dashboard}",
               "temp_dir": temp_dir, "env": env}  # fmt: skip
    finally:
        # `ray start --block`, its GCS and raylet were all still up 20 s after a SIGTERM to the group
        # (the test waited that long for nothing): a moment's grace, then SIGKILL to what is left.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(3)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (left := _ours(temp_dir)) and time.monotonic() < deadline:
            for pid in left:  # those that left the group (Ray's workers start sessions of their own)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        head.wait(10)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not _ours(temp_dir), "the head's processes survived"


def test_a_cluster_without_the_custom_resources_is_refused_in_seconds(plain_head, tmp_path):
    bucket = tmp_path / "bucket"
    cmd = [sys.executable, "jobs/train_grpo.py", "--config", "jobs/configs/cpu_demo.toml", "run_name=nores",
           f"bucket.uri={bucket}"]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**plain_head["env"], "RAY_ADDRESS": plain_head["address"]})  # fmt: skip
    took = time.monotonic() - started
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "generator needs generator" in line and "trainer needs trainer" in line, done.stderr
    assert """ray start --head --resources='{"trainer": 1, "generator": 2}'""" in line
    assert took < 60, f"refused after {took:.0f}s"
    assert not (bucket / "nores" / "summary.json").exists()  # refused: nothing ran


def test_a_relative_bucket_under_ray_job_submit_is_refused(plain_head):
    packages = Path(plain_head["temp_dir"])
    cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", plain_head["dashboard"], "--working-dir", ".",
           "--", "python", "jobs/train_grpo.py", "--config", "jobs/configs/cpu_demo.toml", "run_name=rel",
           "bucket.uri=bucket_rel"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180, env=plain_head["env"])
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "exit code 2" in out, out
    assert "bucket.uri='bucket_rel' is relative, and this Ray job runs in" in out, out
    assert "Pass an absolute path every node mounts" in out
    unpacked = list(packages.glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*"))
    assert unpacked, "the job ran in no package directory"
    assert not [p for p in unpacked if (p / "bucket_rel").exists()]
    assert not (REPO / "bucket_rel").exists()
