"""The system on a cluster whose nodes have their own addresses: a head (the driver), a `proxy` node, a
`trainer` node and two `generator` nodes, each a network namespace with its own loopback
(tests/cluster/netns.py); spare generator nodes, a second trainer node and a second proxy node join mid-run. The shortened demo goes in with `ray job submit`,
as users launch it, with the base model given as a hub id resolved offline from a Hugging Face cache. A
chaos run then finishes every step through what a cloud does to a run (killed engines and actors, the
proxy's node lost, a frozen vLLM, a node cut off the network, lost nodes, a preemption notice), and a third run goes through a
killed trainer, `ray job stop`, a killed driver and `--resume`.

While the first run trains, the test looks at it from another node, as an attacker on the network
would: each vLLM replica refuses every route without the run's key, and the proxy's control routes
refuse a request without its token."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest
from cluster.hub import write_hub_cache
from cluster.metric_names import all_metric_names
from cluster.netns import NamespaceCluster
from conftest import alive, descendants
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
# A trainer node holds two ranks (the resume run trains on two, the chaos run on one).
NODES = {"head": {}, "trainer": {"trainer": 2}, "gen0": {"generator": 1}, "gen1": {"generator": 1},
         "spare": {"generator": 1}, "spare2": {"generator": 1}, "trainer2": {"trainer": 2},
         "trainer3": {"trainer": 2}, "proxy": {"proxy": 1}, "proxy2": {"proxy": 1},
         "proxy3": {"proxy": 1}}  # fmt: skip
# spare, spare2, trainer2, proxy2 and proxy3 join mid-run, in the chaos run; trainer3 before the resume
# run's last job, whose two ranks span two trainer nodes. The proxy runs on a node of its own (a `proxy`
# resource).
SPARE = ("spare", "spare2", "trainer2", "trainer3", "proxy2", "proxy3")
HUB_ID = "local/tiny-qwen2"
UNRESPONSIVE_S = 20  # trainer.unresponsive_timeout_s of the resume run, whose rank 0 is SIGSTOPped
# In the head's environment only, as a pod spec's secret would put them: the driver inherits them and hands
# them to the actors; no Ray view of the job may show them.
HEAD_SECRETS = {"HF_TOKEN": "hf_fake" + uuid.uuid4().hex, "WANDB_API_KEY": "fakewandb" + uuid.uuid4().hex}
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


@pytest.fixture(scope="module")
def cluster():
    # Ray declares a node dead after 5 failed health checks in a row (3 s apart): ~15 s for a machine that is
    # gone, ~22 s for one cut off (the first check times out at 10 s, then gRPC fails the rest at once). The
    # chaos run's 30 s cut is meant as a partition, not a loss: 10 failures, as an operator of a network
    # with short partitions would set it.
    tolerant = {"RAY_health_check_failure_threshold": "10"}
    with NamespaceCluster(
        "rlc",
        "10.231.7",
        NODES,
        env=tolerant,
        node_env={"head": HEAD_SECRETS},
        later=SPARE,
        host_address=True,
    ) as ns:
        yield ns


@pytest.fixture(scope="module")
def hub_env(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """The tiny model as hub id local/tiny-qwen2 in a private HF cache, and the offline switch."""
    hf_home = tmp_path_factory.mktemp("hf-home")
    write_hub_cache(tiny_model_dir, hf_home / "hub", HUB_ID)
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


def submit(cluster: NamespaceCluster, job_id: str, env: dict[str, str], overrides: list[str]) -> None:
    entrypoint = ["env", *(f"{k}={v}" for k, v in env.items()), "python", "jobs/train_grpo.py",
                  "--config", "jobs/configs/cpu_demo.toml", *overrides]  # fmt: skip
    cluster.run("head", ["ray", "job", "submit", "--address", cluster.dashboard, "--working-dir", ".",
                         "--submission-id", job_id, "--no-wait", "--", *entrypoint], timeout=300)  # fmt: skip


def job_api(cluster: NamespaceCluster, path: str) -> dict:
    """GET `/api/jobs/<path>` of the head's dashboard from this process (the bridge has an address here,
    host_address): a poll is one HTTP request, not a Python process importing Ray inside the head's
    namespace, which took a second of CPU a round from the run under test on 2 cores."""
    with urllib.request.urlopen(f"{cluster.dashboard}/api/jobs/{path}", timeout=60) as response:
        return json.loads(response.read())


def job_status(cluster: NamespaceCluster, job_id: str) -> str:
    return job_api(cluster, job_id)["status"]


def job_logs(cluster: NamespaceCluster, job_id: str) -> str:
    return job_api(cluster, f"{job_id}/logs")["logs"]


def wait_for_log(cluster, job_id: str, pattern: str, timeout_s: float, after: int = 0) -> re.Match:
    """The first match of `pattern` in the job's log from character `after` on (a log only grows: a
    fault's lines are looked for after what was there when it was dealt)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = job_logs(cluster, job_id)
        if match := re.compile(pattern).search(logs, after):
            return match
        if job_status(cluster, job_id) in TERMINAL:
            break
        time.sleep(1)
    logs = job_logs(cluster, job_id)
    kept = cluster.ray_dir(cluster.head) / f"{job_id}.log"  # the whole log, beside the head's Ray logs
    kept.write_text(logs)
    raise AssertionError(
        f"{pattern!r} never appeared in the job's logs (all of them: {kept}):\n{logs[-5000:]}"
    )


def wait_terminal(cluster, job_id: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while (status := job_status(cluster, job_id)) not in TERMINAL and time.monotonic() < deadline:
        time.sleep(1)
    return status


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in raw if "=" in item)


STATE = """
import json, sys, urllib.request
from ray.util.state import list_actors, list_jobs, list_placement_groups, list_tasks
url = sys.argv[1]
views = {"api/jobs": urllib.request.urlopen(url + "/api/jobs/", timeout=60).read().decode()}
for name, lister in (("actors", list_actors), ("tasks", list_tasks), ("placement groups", list_placement_groups),
                     ("jobs", list_jobs)):
    views[name] = json.dumps(lister(address=url, detail=True, limit=10000, raise_on_missing_output=False), default=str)
print(json.dumps(views))
"""


def ray_views(cluster: NamespaceCluster) -> dict[str, str]:
    """What Ray shows anyone who opens the job API or the state API: view -> its text."""
    out = cluster.run("head", ["python", "-c", STATE, cluster.dashboard], timeout=180).stdout
    return json.loads(out.strip().splitlines()[-1])


def vllm_servers(cluster: NamespaceCluster) -> dict[str, tuple[str, str]]:
    """node -> (URL the replica's vLLM listens on, its key), read off the running processes."""
    servers = {}
    for node, pids in cluster.vllm_pids().items():
        for pid in pids:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "--host" in argv:
                url = f"http://{argv[argv.index('--host') + 1]}:{argv[argv.index('--port') + 1]}"
                servers[node] = (url, environ(pid).get("VLLM_API_KEY", ""))
    return servers


PROBE = """
import json, sys, urllib.request, urllib.error
url, key, paths = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
def status(method, path, headers):
    req = urllib.request.Request(url + path, method=method, headers=headers, data=b"{}" if method == "POST" else None)
    try:
        return urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as e:
        return e.code
auth = {"Authorization": "Bearer " + key} if key else {}
# With the key only GET: a POST /pause or /sleep that gets through would stop the run under test.
print(json.dumps({m + " " + p: [status(m, p, {}), status(m, p, {"Authorization": "Bearer wrong"}),
                  status(m, p, auth) if key and m == "GET" else None] for m, p in paths}))
"""


def probe(cluster, node: str, url: str, key: str, paths: list[tuple[str, str]]) -> dict[str, list]:
    """From `node`'s namespace: each route's status without a key, with a wrong one, and with `key`."""
    out = cluster.run(node, ["python", "-c", PROBE, url, key, json.dumps(paths)], timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


# Not in the demo's export: it runs no held-out eval, and a Ray counter that never counted (no request
# was retried) has no series.
NOT_IN_THE_DEMO = {"ray_rl_trainer_eval", "ray_rl_proxy_retries_total"}


def run_metrics(cluster: NamespaceCluster, run: str) -> dict[str, dict[str, float]]:
    """Every rl_cluster sample of `run` in the nodes' Ray metrics exports: sample name -> node -> value
    (summed over label sets)."""
    found: dict[str, dict[str, float]] = {}
    for node in sorted(cluster.up):  # a node not joined (or lost) exports nothing
        for family in text_string_to_metric_families(cluster.ray_metrics(node)):
            for sample in family.samples:
                if sample.name.startswith("ray_rl_") and sample.labels.get("run") == run:
                    per_node = found.setdefault(sample.name, {})
                    per_node[node] = per_node.get(node, 0.0) + sample.value
    return found


def replica_routes(cluster, url: str, key: str) -> list[tuple[str, str]]:
    """Every route the replica's OpenAPI schema lists, plus the dev-mode routes vLLM leaves out of it."""
    code = ("import sys, urllib.request; r = urllib.request.Request(sys.argv[1] + '/openapi.json', "
            "headers={'Authorization': 'Bearer ' + sys.argv[2]}); print(urllib.request.urlopen(r).read().decode())")  # fmt: skip
    schema = json.loads(cluster.run("trainer", ["python", "-c", code, url, key]).stdout)
    routes = {
        (method.upper(), path) for path, ops in schema["paths"].items() for method in ops if "{" not in path
    }
    dev = ["/pause", "/resume", "/server_info", "/collective_rpc", "/sleep", "/wake_up", "/reset_prefix_cache",
           "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/metrics", "/openapi.json", "/docs"]  # fmt: skip
    routes |= {
        ("GET" if p in ("/server_info", "/metrics", "/openapi.json", "/docs") else "POST", p) for p in dev
    }
    return sorted(routes)


def look_from_other_nodes(cluster: NamespaceCluster, proxy_url: str, run: str) -> list[str]:
    """While the run trains, before any fault: each replica's vLLM on its own node's address refuses every
    route without the run's key, seen from the trainer's node; the proxy's routes but /health and /metrics
    refuse anyone without the run's token, seen from a generator's node; the driver's secrets reached the
    actors on the other nodes; every rl_cluster metric is in Ray's export of the node its actor runs on.
    Returns the replicas' keys (no log may show them)."""
    servers = vllm_servers(cluster)
    assert set(servers) == {"gen0", "gen1"}, servers
    for node, (url, key) in servers.items():
        assert url.startswith(f"http://{cluster.addresses[node]}:"), (node, url)  # its node's address
        assert len(key) >= 32
        routes = replica_routes(cluster, url, key)
        assert len(routes) > 20
        for route, (anonymous, wrong, right) in probe(cluster, "trainer", url, key, routes).items():
            if route == "GET /health":
                assert anonymous == 200
            else:
                assert (anonymous, wrong) == (401, 401), (node, route, anonymous, wrong)
                assert right is None or right != 401, (node, route)
    # The driver's secrets reached the actors on the other nodes (not through a runtime_env).
    for node, pids in cluster.vllm_pids().items():
        assert all(environ(pid).get("HF_TOKEN") == HEAD_SECRETS["HF_TOKEN"] for pid in pids), node
    trainer_envs = [environ(pid) for pid in cluster.pids()["trainer"] if Path(f"/proc/{pid}").exists()]
    assert any(e.get("WANDB_API_KEY") == HEAD_SECRETS["WANDB_API_KEY"] for e in trainer_envs)
    assert proxy_url.startswith(f"http://{cluster.addresses['proxy']}:"), proxy_url  # its own node
    # From another node: every proxy route but /health and /metrics demands the run's token, generation too.
    guarded = [("POST", "/pause"), ("POST", "/resume"), ("POST", "/v1/load_lora_adapter"),
               ("POST", "/v1/unload_lora_adapter"), ("GET", "/replicas"), ("POST", "/v1/completions"),
               ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/server_info")]  # fmt: skip
    proxy_routes = probe(cluster, "gen0", proxy_url, "", [*guarded, ("GET", "/health"), ("GET", "/metrics")])
    for route, (anonymous, wrong, _) in proxy_routes.items():
        expected = (200, 200) if route in ("GET /health", "GET /metrics") else (401, 401)
        assert (anonymous, wrong) == expected, route

    # Ray's own metrics export, on each node: every rl_cluster metric of this run, from the actor there.
    expected = all_metric_names() - NOT_IN_THE_DEMO
    deadline = time.monotonic() + 180
    while not expected <= set(found := run_metrics(cluster, run)) and time.monotonic() < deadline:
        time.sleep(5)
    assert expected <= set(found), sorted(expected - set(found))
    assert set(found["ray_rl_trainer_step"]) == {"trainer"} and found["ray_rl_trainer_step"]["trainer"] >= 1
    assert set(found["ray_rl_proxy_in_flight"]) == {"proxy"}
    assert set(found["ray_rl_generator_up"]) == {"gen0", "gen1"}, found["ray_rl_generator_up"]
    assert all(v == 1 for v in found["ray_rl_generator_up"].values())
    assert found["ray_rl_generator_adapters_loaded"]["gen0"] >= 1
    assert found["ray_rl_trainer_staleness_count"]["trainer"] >= 8  # every pulled sample observed
    assert found["ray_rl_proxy_requests_total"]["proxy"] > 0
    return [key for _, key in servers.values()]


def no_secret_shown(cluster: NamespaceCluster, run_dir: Path, logs: str, keys: list[str]) -> None:
    """The replica keys and the driver's secrets never reach a log, the resolved config or the summary
    (every node's Ray directory: its logs, and the job's working directory with the vLLM logs), nor any
    view Ray gives of the job: the job API and the state API (actors, tasks, placement groups)."""
    secrets = [*keys, *HEAD_SECRETS.values()]
    written = [*run_dir.glob("*.json*"), *(p for node in NODES for p in cluster.ray_dir(node).rglob("*"))]
    assert any(p.name.startswith("vllm-g") for p in written)  # the scan reaches the replicas' own logs
    for path in written:
        if path.is_file():
            text = path.read_text(errors="replace")
            assert not any(secret in text for secret in secrets), f"a secret leaked into {path}"
    assert all(secret not in logs for secret in secrets)
    views = ray_views(cluster)
    assert "TRL_EXPERIMENTAL_SILENCE" in views["actors"]  # the views do show a runtime_env's env_vars
    for view, text in views.items():
        assert not any(secret in text for secret in secrets), f"a secret is shown by Ray's {view}"


def a_finished_run(run_dir: Path, summary: dict, logs: str, keep_checkpoints: int, every: int) -> None:
    """What a run that ended leaves, whatever it went through: a quiet console with the summary, rewards
    that rose, every version numbered once in order, the newest adapters and checkpoints (one each
    `every` steps) with their manifests, the prefix-cache counters, the W&B run offline beside the run's
    files."""
    steps = summary["steps"]
    assert re.search(rf"step +{steps}/", logs) and "reward, last fifth" in logs
    # A quieter console: progress lines and the summary, without wandb's or transformers' chatter or colour
    # codes around the actors' prefixes (a file is no terminal; Ray's own connect line has some).
    noise = [n for n in ("wandb: ", "there is already one") if n in logs]
    assert not noise and not re.search(r"\x1b\[[0-9;]*m\(", logs), (noise, logs[:6000])
    # Reward rose: the last fifth beats the first, and so does the whole second half.
    rewards = [json.loads(line)["reward"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["reward_last_fifth"] - summary["reward_first_fifth"] >= 0.1, summary
    half = len(rewards) // 2
    assert statistics.mean(rewards[half:]) > statistics.mean(rewards[:half]) + 0.05, rewards
    # Packed attention (our CPU replacement of TRL's kernel) scores step 1's tokens as the sampler did.
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["kl"] is not None and abs(first["kl"]) < 1e-4, first
    # Versions are numbered in order and never reused (a restarted trainer skips what its dead life
    # published after its checkpoint); the newest adapters are in the bucket, each with its manifest.
    published = [int(name.rsplit("-v", 1)[1]) for name in summary["versions_published"]]
    assert published[0] == 1 and published == sorted(set(published)) and len(published) >= steps + 1, (
        published
    )
    for name in summary["versions_published"][-3:]:
        manifest = json.loads((run_dir / "adapters" / name / "manifest.json").read_text())
        assert manifest["version"] == int(name.rsplit("-v", 1)[1])
        assert manifest["base_model"] == HUB_ID
        assert (run_dir / "adapters" / name / "adapter_model.safetensors").exists()
    # The newest checkpoints, committed by their manifests; the summary lists only what is still there.
    kept = [Path(uri).name for uri in summary["checkpoints"]]
    newest = int(kept[-1].removeprefix("step-"))
    assert newest % every == 0 and steps - 2 * every < newest <= steps and len(kept) == keep_checkpoints, kept
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == sorted(kept)
    manifest = json.loads((run_dir / "checkpoints" / kept[-1] / "manifest.json").read_text())
    assert {"adapter_model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(manifest["files"])
    # The engines' own prefix-cache counters, read from each replica's vLLM /metrics at the end.
    cache = summary["prefix_cache"]
    assert set(cache["replicas"]) <= set(summary["requests"]) and cache["replicas"], cache
    assert all(c["queries"] > 0 and 0 <= c["hits"] <= c["queries"] for c in cache["replicas"].values()), cache
    assert 0.0 <= cache["hit_rate"] <= 1.0 and "prefix cache hits" in logs
    # The W&B run, offline beside the run's files (one directory per life of the trainer, one run id).
    assert [p.stat().st_size > 0 for p in run_dir.glob("wandb/offline-run-*/run-*.wandb")] in (
        [True],
        [True, True],
    )


NODE_ID = """
import sys
from ray.util.state import list_nodes
print(next(n.node_id for n in list_nodes(address=sys.argv[1]) if n.node_ip == sys.argv[2] and n.state == "ALIVE"))
"""


def drain_node(cluster: NamespaceCluster, node: str, deadline_s: int) -> None:
    """What an autoscaler does on a spot termination notice: Ray's drain of `node`, with a deadline."""
    node_id = cluster.run("head", ["python", "-c", NODE_ID, cluster.dashboard, cluster.addresses[node]])
    cluster.run("head", ["ray", "drain-node", "--address", f"{cluster.head_address}:6379", "--node-id",
                         node_id.stdout.strip(), "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                         "spot termination notice", f"--deadline-remaining-seconds={deadline_s}"])  # fmt: skip


def pids_running(cluster: NamespaceCluster, node: str, marker: bytes) -> list[int]:
    """Processes in `node`'s namespace whose command line contains `marker`."""
    found = []
    for pid in cluster.pids()[node]:
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "):
                found.append(pid)
        except OSError:
            continue
    return found


# Never reached: the test stops the run (Ctrl-C) once every fault is over. No fixed length fits every
# machine: the faults were over at step 357 in one run and not yet at step 500 in another (training with
# one replica is fast on an idle machine), and a margin for the fastest wastes minutes on the slowest.
CHAOS_STEPS = 5000


def engine_cores(cluster: NamespaceCluster, node: str) -> list[int]:
    """vLLM's engine-core processes in `node`'s namespace (their process name, not their command line)."""
    found = []
    for pid in cluster.pids()[node]:
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Engine"):
                found.append(pid)
        except OSError:
            continue
    return found


def test_a_four_node_job_trains_through_what_a_cloud_does_to_it(cluster, hub_env, tmp_path):
    """The shortened demo through `ray job submit` on four nodes, with the base model a hub id resolved
    offline. While it trains, before any fault, it is looked at from other nodes (look_from_other_nodes).
    Then it is dealt a schedule of faults; each phase waits until the run recovered from the one before:
    (1) g0's engine core SIGKILLed, and g1's vLLM SIGSTOPped for 60 s, at once (no replica serves for a
        while: the proxy holds the requests); each generator restarts its server.
    (2) the proxy's node lost: Ray restarts the proxy on the other `proxy` node, at that node's address;
        the pool controller restores it there, and the trainer and its rollout process follow it.
    (3) at once: g0's generator actor SIGKILLed (Ray restarts it on its node), g1's node cut off the network
        for 30 s (its link down: nothing refused, nothing answers), and the trainer's node lost (Ray restarts
        the trainer on the second trainer node, which resumes from the newest checkpoint).
    (4) at once: g1's node lost (every process SIGKILLed, as a preempted spot machine), and g0's node gets
        a preemption notice (Ray's drain, with a deadline): g1 comes back on a spare node; g0 finishes what
        it has in flight and leaves, its replacement starts at once on the other spare, and the drained node
        goes at its deadline. No replica serves until one of them does.
    (5) a preemption notice for the proxy's node: the pool controller has Ray restart the proxy on the third
        `proxy` node at once, before the deadline, and restores it there; the trainer follows it.
    The run finishes every step with served = trained, no group failed and its reward risen; summary.json
    lists each fault, whom it hit and how long until it was over; no secret shows anywhere."""
    bucket, run, job = tmp_path / "bucket", "mn-chaos", "rlc-chaos"
    submitted = time.monotonic()
    submit(cluster, job, hub_env, [f"run_name={run}", f"bucket.uri={bucket}", f"model.path={HUB_ID}",
                                   f"trainer.max_steps={CHAOS_STEPS}", "trainer.checkpoint_every=5",
                                   "trainer.max_new_tokens=16"])  # fmt: skip
    proxy_url = wait_for_log(cluster, job, r"proxy listening on (http://\S+);", 900).group(1)
    at = {g: wait_for_log(cluster, job, rf"generator {g} +on (\S+)", 900).group(1) for g in ("g0", "g1")}
    node_of = {g: next(n for n, a in cluster.addresses.items() if a == at[g]) for g in at}
    assert set(node_of.values()) == {"gen0", "gen1"}, node_of  # one generator node each
    wait_for_log(cluster, job, rf"trainer +on {cluster.addresses['trainer']}", 900)
    wait_for_log(cluster, job, rf"step +1/{CHAOS_STEPS}", 900)
    print(f"\nray job submit -> first training step: {time.monotonic() - submitted:.0f} s")
    keys = look_from_other_nodes(cluster, proxy_url, run)
    cluster.join("trainer2")  # the second trainer node
    wait_for_log(cluster, job, rf"step +5/{CHAOS_STEPS}", 900)
    took: dict[str, float] = {}

    began = time.monotonic()

    def mark() -> tuple[int, float]:
        logs = job_logs(cluster, job)
        step = re.findall(rf"step +(\d+)/{CHAOS_STEPS}", logs)[-1]
        print(f"\nchaos run: a phase begins at step {step}, {time.monotonic() - began:.0f} s in", flush=True)
        return len(logs), time.monotonic()

    def trains_on(after: int) -> None:  # training went on after the phase: two more steps
        steps = re.findall(rf"step +(\d+)/{CHAOS_STEPS}", job_logs(cluster, job))
        wait_for_log(cluster, job, rf"step +{int(steps[-1]) + 2}/{CHAOS_STEPS}", 600, after)

    # (1) an engine core killed, and a vLLM frozen for 60 s
    logged, t0 = mark()
    frozen = cluster.vllm_pids()[node_of["g1"]]
    (core,) = engine_cores(cluster, node_of["g0"])
    os.kill(core, signal.SIGKILL)
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    # vLLM's API server exits when its engine core died, or stays up answering 503: restarted either way.
    wait_for_log(cluster, job, r"replica g0: vLLM server (exited with code -?\d+|failed /health 3 times in a row); "
                               r"restart 1/", 120, logged)  # fmt: skip
    wait_for_log(
        cluster, job, r"replica g1: vLLM server failed /health 3 times in a row; restart 1/", 120, logged
    )
    wait_for_log(cluster, job, r"replica g0: serving again", 400, logged)
    took["engine core killed"] = time.monotonic() - t0
    wait_for_log(cluster, job, r"replica g1: serving again", 400, logged)
    took["vLLM frozen"] = time.monotonic() - t0
    time.sleep(max(0.0, t0 + 60 - time.monotonic()))
    for pid in frozen:  # what is left of them: the generator stopped its frozen server (SIGKILL reaches it)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    trains_on(logged)

    # (2) the proxy's node lost (a process killed, restarted in place, is test_s3_run's)
    cluster.join("proxy2")
    logged, t0 = mark()
    assert cluster.lose("proxy")
    moved = re.escape(f"http://{cluster.addresses['proxy2']}:")
    wait_for_log(cluster, job, rf"proxy restarted by Ray: serving again on {moved}", 300, logged)
    wait_for_log(
        cluster, job, rf"trainer: the proxy serves on {moved}\d+ now; following it there", 120, logged
    )
    took["proxy's node lost"] = time.monotonic() - t0
    trains_on(logged)

    # (3) a generator actor killed, a node cut off for 30 s, and the trainer's node lost, at once
    logged, t0 = mark()
    (generator_pid,) = pids_running(cluster, node_of["g0"], b"ray::Generator")
    os.kill(generator_pid, signal.SIGKILL)
    cluster.cut(node_of["g1"])
    assert cluster.lose("trainer")
    wait_for_log(cluster, job, r"replica g1 left routing", 60, logged)
    time.sleep(max(0.0, t0 + 30 - time.monotonic()))
    cluster.restore(node_of["g1"])
    wait_for_log(cluster, job, rf"replica g0: actor died; Ray restarted its generator actor on {at['g0']};", 300,
                 logged)  # fmt: skip
    wait_for_log(cluster, job, r"replica g1 back in routing: caught up", 300, logged)
    took["link cut for 30 s"] = time.monotonic() - t0
    resumed = wait_for_log(cluster, job, r"trainer restarted by Ray: resuming from checkpoint step (\d+)", 600,
                           logged)  # fmt: skip
    wait_for_log(cluster, job, r"replica g0: serving again after its actor's restart", 600, logged)
    took["generator actor killed"] = time.monotonic() - t0
    trains_on(resumed.end())
    took["trainer's node lost"] = time.monotonic() - t0

    # (4) a generator's node lost, and a preemption notice for the other's, at once
    cluster.join("spare")
    cluster.join("spare2")
    spares = {cluster.addresses["spare"], cluster.addresses["spare2"]}
    logged, t0 = mark()
    assert cluster.lose(node_of["g1"])
    drain_node(cluster, node_of["g0"], deadline_s=120)
    wait_for_log(cluster, job, rf"pool: g0 leaves: its node {at['g0']} is draining \(deadline in", 60, logged)
    moved = wait_for_log(cluster, job, r"replica g1: node lost \((\S+?)[:)].*?; Ray restarted its "
                                       r"generator actor on (\S+);", 300, logged)  # fmt: skip
    assert moved.group(1) == at["g1"] and moved.group(2) in spares, moved.group(0)
    wait_for_log(cluster, job, r"pool: g0 drained in .* and stopped", 150, logged)
    wait_for_log(cluster, job, r"replica g1: serving again after its actor's restart", 600, logged)
    took["generator node lost"] = time.monotonic() - t0
    wait_for_log(cluster, job, r"pool: \['g2'\] caught up and active", 600, logged)
    took["preemption notice"] = time.monotonic() - t0
    cluster.lose(node_of["g0"])  # its deadline: the machine goes (Ray let it go once it was empty)
    trains_on(logged)

    # (5) a preemption notice for the proxy's node: it moves before the deadline
    cluster.join("proxy3")
    logged, t0 = mark()
    drain_node(cluster, "proxy2", deadline_s=120)
    there, moved = cluster.addresses["proxy2"], re.escape(f"http://{cluster.addresses['proxy3']}:")
    wait_for_log(cluster, job, rf"pool: the proxy's node {re.escape(there)} is draining: Ray restarts the proxy "
                               rf"on {re.escape(cluster.addresses['proxy3'])}", 60, logged)  # fmt: skip
    wait_for_log(cluster, job, rf"proxy restarted by Ray: serving again on {moved}", 300, logged)
    wait_for_log(
        cluster, job, rf"trainer: the proxy serves on {moved}\d+ now; following it there", 120, logged
    )
    took["proxy's node drained"] = time.monotonic() - t0
    cluster.lose("proxy2")  # its deadline
    steps_then = re.findall(rf"step +(\d+)/{CHAOS_STEPS}", job_logs(cluster, job))[-1]
    print("\nchaos run, seconds until the run was over each fault (as this test saw it): "
          + ", ".join(f"{what} {s:.0f}" for what, s in took.items()) + f"; at step {steps_then}")  # fmt: skip
    # Training goes on on both replicas for a while, then the run is stopped as a user's Ctrl-C does.
    # Ten steps: both replicas serve (g1's new engine on the spare must have prefix-cache counters to read;
    # after four steps it once had none).
    wait_for_log(cluster, job, rf"step +{int(steps_then) + 10}/{CHAOS_STEPS}", 600, logged)
    (driver,) = (pid for pid in pids_running(cluster, "head", b"jobs/train_grpo.py")
                 if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"python"))  # fmt: skip
    os.kill(driver, signal.SIGINT)

    status = wait_terminal(cluster, job, 600)
    logs = job_logs(cluster, job)
    assert status == "FAILED" and f"run {run}: stop requested" in logs, logs[-6000:]  # exit status 1: stopped
    summary = json.loads((bucket / run / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps"] > int(steps_then), summary
    steps = [json.loads(line)["step"] for line in (bucket / run / "metrics.jsonl").read_text().splitlines()]
    # Every step, each once (the trainer trains on while the driver asks each actor for its part of the
    # summary, and writes metrics.jsonl last: it may hold a step or two more).
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= summary["steps"], (steps[-5:], summary)
    groups = summary["groups"]  # (the step under way when it stopped may have pulled its groups)
    assert summary["steps"] * 4 <= groups["trained"] <= (summary["steps"] + 1) * 4, groups
    assert groups["failed"] == 0, groups  # no request failed for good
    assert summary["served_check"]["match"] >= 1 and summary["served_check"]["mismatch"] == 0, summary
    assert (summary["trainer_restarts"], summary["proxy_restarts"]) == (1, 2), summary
    assert summary["placement"]["trainer"]["address"] == cluster.addresses["trainer2"], summary["placement"]
    assert summary["placement"]["proxy"]["address"] == cluster.addresses["proxy3"], summary["placement"]
    # Each replica's places, and what ended each.
    history = {g: [(s["address"], s["ended_by"] and s["ended_by"].split(" (")[0]) for s in lives]
               for g, lives in summary["placement_history"].items()}  # fmt: skip
    g1_now, g2_at = history["g1"][-1][0], history["g2"][0][0]
    assert {g1_now, g2_at} == spares, history  # one spare each
    assert history == {"g0": [(at["g0"], "actor died"), (at["g0"], "node drained")],
                       "g1": [(at["g1"], "node lost"), (g1_now, None)], "g2": [(g2_at, None)]}, history  # fmt: skip
    # g1: its server, then its node (g0, drained, has left the pool).
    assert summary["replica_restarts"] == {"g1": 2, "g2": 0}, summary["replica_restarts"]
    # Every fault, whom it hit, and the seconds until it was over.
    faults = Counter((f["who"], f["what"].split(" (")[0]) for f in summary["faults"])
    dealt = Counter([("g0", "actor died"), ("g0", "node drained"), ("g0", "vLLM server restarted"),
                     ("g1", "node lost"), ("g1", "out of routing"), ("g1", "vLLM server restarted"),
                     ("proxy", "proxy restarted by Ray"), ("proxy", "proxy restarted by Ray"),
                     ("trainer", "trainer restarted by Ray")])  # fmt: skip
    assert not dealt - faults, summary["faults"]  # each fault dealt is recorded
    # Besides: a replica whose health probe went unanswered for a while on a loaded machine (CI's slowest
    # run: g0, once) is a fault too, recorded as such; nothing else may be.
    for who, kind in faults - dealt:
        assert kind == "out of routing" and any(
            f["who"] == who and f["what"].startswith("out of routing (health check failed")
            for f in summary["faults"]
        ), summary["faults"]
    assert all(f["recovered_s"] is not None and f["recovered_s"] > 0 for f in summary["faults"]), summary[
        "faults"
    ]
    what = {(f["who"], f["what"].split(" (")[0]): f["what"] for f in summary["faults"]}
    assert what[("g0", "vLLM server restarted")].startswith("vLLM server restarted (vLLM server "), what
    assert what[("g1", "vLLM server restarted")] == (
        "vLLM server restarted (vLLM server failed /health 3 times in a row)"
    )
    assert "out of routing (health check failed: no answer within 10 s)" in [  # the cut
        f["what"] for f in summary["faults"] if f["who"] == "g1"
    ], summary["faults"]
    assert what[("trainer", "trainer restarted by Ray")] == (
        f"trainer restarted by Ray (from checkpoint step {resumed.group(1)})"
    )
    # The summary table the driver printed says the same.
    rows = [" ".join(line.split()) for line in logs.splitlines()]
    assert any(r.startswith("fault, trainer trainer restarted by Ray") and "training again after" in r
               for r in rows), logs[-4000:]  # fmt: skip
    assert any(r.startswith("fault, g1 out of routing (health check failed: no answer") for r in rows), logs[
        -4000:
    ]
    # Both replicas that end the run served, and hold the newest version.
    assert summary["requests"]["g1"] > 0 and summary["requests"]["g2"] > 0, summary["requests"]
    assert all(summary["versions_published"][-1] in summary["versions_loaded"][g] for g in ("g1", "g2"))
    a_finished_run(bucket / run, summary, logs, keep_checkpoints=2, every=5)
    no_secret_shown(cluster, bucket / run, logs, keys)

    deadline = time.monotonic() + 60
    while cluster.vllm_pids() and time.monotonic() < deadline:
        time.sleep(1)
    assert not cluster.vllm_pids(), "a vLLM server outlived the run"


def wait_for_file(path: Path, timeout_s: float) -> None:
    """Finely: a run's checkpoint is committed by its manifest, and a test may have to act at once."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s:.0f} s"
        time.sleep(0.2)


def adapter_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


def test_a_killed_trainer_a_stopped_job_and_a_killed_driver_resume(cluster, hub_env, tmp_path):
    """Two trainer ranks (FSDP2 over gloo: each holds half the model) on one trainer node. (a) SIGKILL rank 1 (a Ray Train worker): Ray
    Train restarts the whole gang, which resumes from the newest checkpoint, every rank from the same step.
    Then SIGSTOP the new rank 0 (a paused VM): nothing dies and rank 1 waits for it in a collective; Ray
    Train's health check counts it dead after trainer.unresponsive_timeout_s, and the gang restarts and
    resumes again, leaving neither the stopped process nor its rollout child behind. Then `ray job stop`
    ends the run with its summary written and nothing left running. (b) SIGKILL the
    driver of the run continued with --resume: the job dies, and (c) --resume once more takes it to its
    max_steps, its two ranks on two trainer nodes (gloo across the nodes). Versions are never renumbered;
    the resumed policy is the checkpoint's (its first published adapter holds the checkpoint's weights, bit
    for bit)."""
    bucket, run = tmp_path / "bucket", "mn-resume"
    keep = [f"bucket.uri={bucket}", f"model.path={HUB_ID}", "trainer.checkpoint_every=4",
            "trainer.keep_checkpoints=20", "bucket.keep_every=1", "trainer.num_workers=2",
            "trainer.num_cpus=0.5", "trainer.max_restarts=2", f"trainer.unresponsive_timeout_s={UNRESPONSIVE_S}",
            "trainer.strategy=fsdp2"]  # fmt: skip
    submit(cluster, "rlc-res-a", hub_env, [f"run_name={run}", "trainer.max_steps=40", *keep])
    # Killed as soon as checkpoint 8 is committed (its manifest): polling the job's log took seconds a
    # round, and a fast trainer had finished all 16 steps before the kill landed (then its restart
    # resumes at max_steps and trains nothing, which is right, but not this test).
    wait_for_file(bucket / run / "checkpoints" / "step-8" / "manifest.json", 900)
    # The trainer's node: the chaos run before may have moved it to the second trainer node.
    (node,) = (n for n in sorted(cluster.up) if pids_running(cluster, n, b"ray::RayTrainWorker"))
    ranks = dict(re.findall(r"trainer rank (\d)/2 on \S+ \(pid (\d+)\)", job_logs(cluster, "rlc-res-a")))
    assert sorted(map(int, ranks.values())) == sorted(pids_running(cluster, node, b"ray::RayTrainWorker")), (
        ranks
    )
    rank0, rank1 = int(ranks["0"]), int(ranks["1"])
    # TRL's rollout child (a fork of rank 0's fork server, compat item 23), of rank 0 alone.
    rollout_children = descendants(cluster.pids()[node], rank0)
    assert len(rollout_children) >= 2, rollout_children
    assert not descendants(cluster.pids()[node], rank1)
    cluster.run(node, ["kill", "-9", str(rank1)])
    resumed = wait_for_log(cluster, "rlc-res-a", r"trainer restarted by Ray: resuming from checkpoint step (\d+); "
                                                 r"versions continue after v(\d+)", 600)  # fmt: skip
    ckpt, highest = int(resumed.group(1)), int(resumed.group(2))
    # The restarted gang's rank 0 SIGSTOPped once it committed a checkpoint of its own.
    wait_for_file(bucket / run / "checkpoints" / f"step-{ckpt + 4}" / "manifest.json", 600)
    seen = len(job_logs(cluster, "rlc-res-a"))
    ranks = dict(re.findall(r"trainer rank (\d)/2 on \S+ \(pid (\d+)\)", job_logs(cluster, "rlc-res-a")))
    stopped, peer = int(ranks["0"]), int(ranks["1"])  # the newest line of each rank: the restarted gang's
    (node,) = (n for n in sorted(cluster.up) if pids_running(cluster, n, b"ray::RayTrainWorker"))
    assert sorted(pids_running(cluster, node, b"ray::RayTrainWorker")) == sorted([stopped, peer]), ranks
    stopped_children = descendants(cluster.pids()[node], stopped)
    assert len(stopped_children) >= 2, stopped_children  # its fork server and rollout child
    os.kill(stopped, signal.SIGSTOP)  # the namespaces share the host's pids
    try:
        again = wait_for_log(cluster, "rlc-res-a", r"trainer restarted by Ray: resuming from checkpoint step "
                             r"(\d+); versions continue after v(\d+)", UNRESPONSIVE_S + 600, after=seen)  # fmt: skip
    finally:
        if alive(stopped):
            os.kill(stopped, signal.SIGCONT)  # never leave a stopped process of ours behind
    # Ended by the bound, not by anything dying: Train's health check names the hang.
    assert "A worker health check has been hanging" in job_logs(cluster, "rlc-res-a")[seen:]
    ckpt2, highest2 = int(again.group(1)), int(again.group(2))
    # Stopped once the twice restarted trainer committed a checkpoint of its own.
    wait_for_file(bucket / run / "checkpoints" / f"step-{ckpt2 + 4}" / "manifest.json", 600)
    cluster.run("head", ["ray", "job", "stop", "--address", cluster.dashboard, "rlc-res-a"], timeout=120)
    assert wait_terminal(cluster, "rlc-res-a", 120) == "STOPPED"
    # Sharded, not a silent DDP (compat item 22), in each of the three gangs.
    logs = job_logs(cluster, "rlc-res-a")
    shares = [int(s) for s in re.findall(r"trainer ranks: fsdp2 over 2; rank 0 holds (\d+)% of", logs)]
    assert len(shares) == 3 and all(45 <= s <= 55 for s in shares), shares
    summary = json.loads((bucket / run / "summary.json").read_text())
    assert ckpt >= 8 and highest > ckpt  # versions were published after the checkpoint
    assert ckpt2 >= ckpt + 4 and highest2 > max(ckpt2, highest)
    assert (summary["status"], summary["trainer_restarts"], summary["resumed_from_step"]) == (
        "stopped",
        2,
        ckpt2,
    )
    assert ckpt2 + 4 <= summary["steps"] < 40 and summary["groups"]["failed"] == 0, summary
    # The check's forwards ran on both shards in lockstep, and found each checked version served as trained.
    assert summary["served_check"]["match"] >= 1 and summary["served_check"]["mismatch"] == 0, summary
    # The twice restarted gang's two ranks (new processes), on the trainer's node.
    placed = summary["trainer_ranks"]
    assert [r["address"] for r in placed] == [cluster.addresses[node]] * 2, placed
    assert not {r["pid"] for r in placed} & {rank0, rank1, stopped, peer}, placed
    numbers = [int(name.rsplit("-v", 1)[1]) for name in summary["versions_published"]]
    # The record up to each checkpoint, then the restarted gang's versions after the highest ever published:
    # the first its republication of the checkpoint's adapter, then one per step (the ones published between
    # a checkpoint and the fault belong to training that was thrown away).
    assert numbers[: ckpt + 1] == list(range(1, ckpt + 2)), numbers
    assert numbers[ckpt + 1 : ckpt2 + 2] == list(range(highest + 1, highest + 2 + ckpt2 - ckpt)), numbers
    assert numbers[ckpt2 + 2 :] == list(range(highest2 + 1, highest2 + 1 + len(numbers) - ckpt2 - 2)), numbers
    assert len(numbers) - ckpt2 - 2 >= 4, numbers
    # The summary table (the stopped driver had no time to print it; `rl-cluster summary` does).
    table = subprocess.run([sys.executable, "-m", "rl_cluster.cli", "summary", run, "--bucket", str(bucket)],
                           capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert any(" ".join(line.split()) == "status stopped" for line in table.stdout.splitlines()), table.stdout
    deadline = time.monotonic() + 60
    while cluster.vllm_pids() and time.monotonic() < deadline:
        time.sleep(1)
    assert not cluster.vllm_pids(), "a vLLM server outlived `ray job stop`"
    # Each restarted trainer starts from its checkpoint's policy, not from the base model.
    for step, first_after in ((ckpt, highest + 1), (ckpt2, highest2 + 1)):
        restored = adapter_tensors(bucket / run / "adapters" / f"{run}-v{first_after}")
        saved = adapter_tensors(bucket / run / "checkpoints" / f"step-{step}")
        assert restored.keys() == saved.keys()
        assert all((restored[name] == saved[name]).all() for name in saved)
    # No orphan: each rank 0, ended with its gang, took its rollout child with it; the stopped one too.
    assert not alive(stopped), "the hung rank outlived its gang"
    assert not [p for p in rollout_children + stopped_children if alive(p)], (
        rollout_children + stopped_children
    )

    # (b) continue the stopped run for two more checkpoints; kill that job's driver at the first.
    later = (summary["steps"] // 4 + 1) * 4  # a checkpoint job (b) makes
    final = later + 8  # (c) resumes from `later` (or the one after, if b got there before its kill)
    submit(cluster, "rlc-res-b", hub_env, ["--resume", run, f"trainer.max_steps={final}", *keep])
    wait_for_file(bucket / run / "checkpoints" / f"step-{later}" / "manifest.json", 900)
    drivers = pids_running(cluster, "head", b"--resume " + run.encode())  # the entrypoint (and its shell)
    assert drivers
    cluster.run("head", ["kill", "-9", *map(str, drivers)])
    assert wait_terminal(cluster, "rlc-res-b", 300) == "FAILED"
    deadline = time.monotonic() + 60
    while cluster.vllm_pids() and time.monotonic() < deadline:
        time.sleep(1)
    assert not cluster.vllm_pids(), "a vLLM server outlived its killed driver"

    # (c) on two trainer nodes: a rank takes a whole node's CPU (each node has one), so no node holds both
    # and the ranks span them (trainer.span_nodes), FSDP2 over gloo between the nodes' addresses.
    cluster.join("trainer3")
    spanning = ["trainer.span_nodes=true", "trainer.num_cpus=1"]
    submit(cluster, "rlc-res-c", hub_env, ["--resume", run, f"trainer.max_steps={final}", *keep, *spanning])
    assert wait_terminal(cluster, "rlc-res-c", 900) == "SUCCEEDED", job_logs(cluster, "rlc-res-c")[-6000:]
    summary = json.loads((bucket / run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["resumed_from_step"] >= later
    spanned = {r["address"] for r in summary["trainer_ranks"]}
    assert len(spanned) == 2 and spanned <= {
        cluster.addresses[n] for n in NODES if n.startswith("trainer")
    }, summary["trainer_ranks"]
    lines = re.findall(r"trainer rank (\d)/2 on (\S+) \(pid", job_logs(cluster, "rlc-res-c"))
    assert sorted(lines) == [(str(i), r["address"]) for i, r in enumerate(summary["trainer_ranks"])], lines
    steps = [json.loads(line)["step"] for line in (bucket / run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, final + 1))  # the whole history, each step once
    # Every version ever published is unique, and numbering only went up across the three jobs.
    # (Not the staging directories a killed publisher left: hidden, as the bucket's own listings skip them.)
    versions = sorted(
        int(p.name.rsplit("-v", 1)[1])
        for p in (bucket / run / "adapters").iterdir()
        if not p.name.startswith(".")
    )
    assert versions == list(range(1, versions[-1] + 1))
    assert summary["versions_published"][-1] == f"{run}-v{versions[-1]}"
