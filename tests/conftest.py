"""Shared fixtures: the locally made tiny model and a pair of real vLLM CPU servers.

The servers are session-scoped because each takes ~30 s to start on 2 cores; tests that change a
server's state (load adapters, pause) must undo it or use names of their own.

Every test that starts vLLM carries the `vllm` marker, so `pytest -m "not vllm"` is the fast lane: those
using the `vllm_servers` or `marked_ray` fixtures and everything under tests/e2e/ are marked here;
modules that start vLLM some other way say `pytestmark = pytest.mark.vllm` themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

# One free-port helper and one moto launcher for the tests and the benchmarks (`python -m bench`), in
# loopback.py at the repository root; tests import them from here.
from loopback import S3_ENV, free_port, moto_s3
from rl_cluster.generator.server import ServerSpec, VLLMServer

__all__ = ["S3_ENV", "free_port", "moto_s3"]

REPO = Path(__file__).resolve().parents[1]
E2E = REPO / "tests" / "e2e"
# Fixtures that exist only to run vLLM servers (marked_ray: a private Ray for tests whose actors start them).
VLLM_FIXTURES = {"vllm_servers", "marked_ray"}


def pytest_unconfigure(config):
    """A test that leaves something behind which blocks interpreter exit (a queue's feeder thread on a full
    pipe, a non-daemon thread) once made CI wait out its whole time limit after every test had passed. If
    this process is still here two minutes after pytest finished, print every thread's stack and exit 1."""
    faulthandler.dump_traceback_later(120, exit=True)


def pytest_configure(config):
    global _config
    _config = config


_config: pytest.Config | None = None


def pytest_report_header(config):
    """What a CI log needs to tell one machine from another: cores, shared memory, what the hostname
    resolves to (torch's gloo binds there: vLLM's tensor-parallel workers and the trainer's ranks)."""
    import shutil
    import socket

    try:
        resolved = socket.gethostbyname(socket.gethostname())
    except OSError as e:
        resolved = f"unresolved ({e})"
    shm = "no /dev/shm"
    if os.path.isdir("/dev/shm"):
        usage = shutil.disk_usage("/dev/shm")
        shm = f"/dev/shm {usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f}"
    cores = f"{os.cpu_count()} cores, affinity {sorted(os.sched_getaffinity(0))}"
    return f"machine: {cores}, {shm}, hostname {socket.gethostname()} -> {resolved}"


def pytest_runtest_logreport(report):
    """A run stopped at CI's time limit never prints its failures, and CI shows the end of its output:
    each failure is printed as it happens (its end, where the assertion is), not only in the summary."""
    terminal = _config and _config.pluginmanager.get_plugin("terminalreporter")
    if report.failed and terminal:
        terminal.write_line("")
        terminal.write_sep("!", f"FAILED {report.nodeid} ({report.when})")
        terminal.write_line(report.longreprtext[-6000:])


def pytest_collection_modifyitems(config, items):
    for item in items:
        if VLLM_FIXTURES & set(item.fixturenames) or E2E in item.path.parents:
            item.add_marker(pytest.mark.vllm)


# -- the tiny models, built beside the unit tests -----------------------------------------------------------
# A clean clone has neither tiny model, and the first test that needed one built it: about 100 s of one
# core (the math model's warm start is 80 s) while the rest of the suite waited. When the session's tests
# need them, one lower-priority process builds them from the start, beside the first tests (the Makefile's
# second session: the fast lane before it builds the add model where a test of its own needs it); each
# fixture waits for its model only.
TINY_CACHE = Path(os.environ.get("RL_CLUSTER_CACHE", REPO / ".cache"))
MATH_TESTS = E2E / "test_math_run.py"
_builder: subprocess.Popen | None = None


def pytest_collection_finish(session):
    global _builder
    from rl_cluster.tiny import tiny_model_path

    needed = {
        "add": any(item.get_closest_marker("vllm") for item in session.items),
        "math": any(item.path == MATH_TESTS for item in session.items),
    }
    tasks = [task for task, need in needed.items() if need and not tiny_model_path(TINY_CACHE, task).is_dir()]
    if tasks:
        TINY_CACHE.mkdir(parents=True, exist_ok=True)
        code = "import sys; from rl_cluster.tiny import ensure_tiny_model as e; [e(sys.argv[1], t) for t in sys.argv[2:]]"
        with open(TINY_CACHE / "prebuild.log", "wb") as log:
            _builder = subprocess.Popen(
                ["nice", "-n", "10", sys.executable, "-c", code, str(TINY_CACHE), *tasks],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip


def pytest_sessionfinish(session):
    if _builder is not None and _builder.poll() is None:  # a session that ended before it was needed
        _builder.kill()
        _builder.wait()


def tiny_model(task: str) -> Path:
    """The tiny model for `task`, once the session's builder has it (or has ended: then this builds it, and
    a failing build fails here with its own error)."""
    from rl_cluster.tiny import ensure_tiny_model, tiny_model_path

    path = tiny_model_path(TINY_CACHE, task)
    while _builder is not None and _builder.poll() is None and not path.is_dir():
        time.sleep(0.5)
    return ensure_tiny_model(TINY_CACHE, task)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tiny_model("add")


@pytest.fixture(scope="session")
def tiny_math_model_dir() -> Path:
    return tiny_model("math")


@pytest.fixture(scope="session")
def vllm_servers(tiny_model_dir, tmp_path_factory) -> list[VLLMServer]:
    """Two real vLLM CPU servers on the tiny model, each pinned to its own core."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    cores = os.cpu_count() or 1
    servers = [
        VLLMServer(
            ServerSpec(model=str(tiny_model_dir), port=free_port(), cpu_cores=(i % cores,)),
            logs / f"r{i}.log",
        )
        for i in range(2)
    ]
    try:
        for server in servers:
            server.start()

        async def wait_all():
            await asyncio.gather(*(s.wait_healthy(300) for s in servers))

        asyncio.run(wait_all())
        yield servers
    finally:
        for server in servers:
            server.stop()


def vllm_pids_with(marker: str) -> set[int]:
    """vLLM server processes whose environment carries `marker` (a NAME=value a test put into the
    environment of what it started): ours, not those of other users of this machine."""
    # The API server, and its engine core and workers (vLLM renames those `VLLM::EngineCore` etc.).
    out = subprocess.run(["pgrep", "-f", "vllm.entrypoints|VLLM::"], capture_output=True, text=True).stdout
    pids = set()
    for pid in map(int, out.split()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if marker.encode() in environ:
            pids.add(pid)
    return pids


def wait_until_no_vllm_with(marker: str, timeout_s: float = 45) -> set[int]:
    """Survivors after `timeout_s` (watchdogs need a few seconds after an owner dies)."""
    deadline = time.monotonic() + timeout_s
    while vllm_pids_with(marker) and time.monotonic() < deadline:
        time.sleep(1)
    return vllm_pids_with(marker)


def save_lora(model_dir, out_dir, seed: int):
    """A rank-1 LoRA on the tiny model whose B matrices are non-zero, so it changes outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    peft = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # make the adapter change outputs
    peft.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def marked_ray():
    """A private local Ray cluster for one test module (two `generator` slots), whose processes carry a
    marker in their environment, so the module can tell its vLLM servers from anyone else's."""
    import uuid

    import ray

    marker = f"RL_CLUSTER_TEST={uuid.uuid4().hex}"
    ray.init(address="local", num_cpus=2, resources={"generator": 2}, include_dashboard=False,
             runtime_env={"env_vars": dict([marker.split("=")])})  # fmt: skip
    yield marker
    ray.shutdown()


def publish_lora(bucket, run: str, version: int, model_dir: Path, work_dir: Path) -> str:
    """Publish a fresh random LoRA on the tiny model as `<run>-v<version>`; returns its URI."""

    from rl_cluster.core.manifest import AdapterMeta
    from rl_cluster.models import model_fingerprint

    src = work_dir / f"lora-src-{version}"
    save_lora(model_dir, src, seed=version)
    return bucket.publish_adapter(
        run, run, version, src,
        AdapterMeta(base_model=str(model_dir), base_fingerprint=model_fingerprint(model_dir), rank=1, alpha=2,
                    target_modules="all-linear", trainer_step=version),
    )  # fmt: skip


def tiny_run_config(run: str, model_dir: Path, tmp_path: Path, *extra: str):
    """A run config on the tiny model with a bucket directory under `tmp_path` and one generator; `extra`:
    more dotted overrides."""
    from rl_cluster.config import load_config

    overrides = [f"run_name={run}", f"model.path={model_dir}", f"bucket.uri={tmp_path / 'bucket'}"]
    return load_config(None, [*overrides, "generator.replicas=1", *extra])


@contextlib.contextmanager
def http_stub(handler):
    """A threaded HTTP server on loopback answering with `handler` (a BaseHTTPRequestHandler class);
    yields its base URL, and is shut down however the test ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def wait_for(
    log: Path, pattern: str, run: subprocess.Popen, count: int = 1, timeout_s: float = 600
) -> list[str]:
    """The first `count` matches of `pattern` in the run's log, once there are that many."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.findall(pattern, log.read_text(errors="replace"), re.M)
        if len(found) >= count:
            return found
        assert run.poll() is None, f"the run exited ({run.returncode}):\n{log.read_text()[-6000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {count}x {pattern!r} within {timeout_s:.0f} s:\n{log.read_text()[-6000:]}")


def the_runs_process(marker: str, title: bytes, timeout_s: float) -> int:
    """The pid of the one process of this run (its environment carries `marker`) whose title starts with
    `title`: vLLM titles its engine core `VLLM::EngineCore`, Ray an actor's worker `ray::<class>`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = []
        for pid in map(
            int, subprocess.run(["pgrep", "-f", "."], capture_output=True, text=True).stdout.split()
        ):
            try:
                if (
                    Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title)
                    and marker.encode() in Path(f"/proc/{pid}/environ").read_bytes()
                ):
                    found.append(pid)
            except OSError:
                continue
        if len(found) == 1:
            return found[0]
        time.sleep(0.5)
    raise AssertionError(f"no single {title.decode()} process of the run within {timeout_s:.0f} s")


def parent_pid(pid: int) -> int | None:
    """The parent of a process, from /proc (None once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pids, root: int) -> list[int]:
    """Those of `pids` that run under process `root` (children, and theirs)."""
    parents = {p: parent_pid(p) for p in pids}
    under, found = {root}, True
    while found:
        found = {p for p, parent in parents.items() if parent in under and p not in under}
        under |= found
    return sorted(under - {root})


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"  # a zombie has exited
    except OSError:
        return False


def stop_run(run: subprocess.Popen) -> None:
    """A run's driver still running when its test ends: SIGINT (the run stops its actors and its local Ray
    itself), then SIGKILL after 120 s."""
    if run.poll() is None:
        run.send_signal(signal.SIGINT)
        try:
            run.wait(timeout=120)
        except subprocess.TimeoutExpired:
            run.kill()
