"""A Ray cluster whose nodes are Linux network namespaces: each node has its own loopback and its own
address on a bridge the harness creates, so a server bound to 127.0.0.1 on one node is unreachable
from the others, as on a real cluster. (`ray.cluster_utils.Cluster` puts every node on one address and
one loopback, which hides exactly those bugs.)

All namespaces share the filesystem, so a directory stands in for a bucket every node mounts, except
Ray's own directory: each node's Ray runs with a private /tmp/ray (a bind mount in the mount namespace
`ip netns exec` gives it), as on separate machines. Shared, the nodes' runtime-env agents unpack and
garbage-collect the same `runtime_resources/working_dir_files/...` directories: a job's working
directory vanished under its driver (FileNotFoundError from os.getcwd()), every node's log monitor
tailed every node's logs (each line four times, wrong `ip=` prefixes), and `ray start --head` wrote the
machine's `/tmp/ray/ray_current_cluster`. Traffic stays on the bridge's private /24. `close()` ends every process inside the namespaces (by the
pids `ip netns pids` lists: only what this harness started), deletes links and namespaces, and removes
the address file `ray start --head` leaves in /tmp/ray; it runs also when a test fails.

    with NamespaceCluster("rlc", "10.231.7", {"head": {}, "trainer": {"trainer": 1}}) as cluster:
        cluster.run("head", ["ray", "job", "submit", ...])
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
RAY_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")
METRICS_PORT = 8090  # every node's Ray metrics export (Prometheus text); each namespace has its own ports


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class NamespaceCluster:
    """`nodes`: name -> custom resources, the first one is the head. Node i gets `<subnet>.<i+1>`."""

    def __init__(self, prefix: str, subnet: str, nodes: dict[str, dict], env: dict[str, str] | None = None,
                 num_cpus: int = 1, head_args: list[str] = (), host_address: bool = False,
                 node_env: dict[str, dict[str, str]] | None = None, later: tuple[str, ...] = ()):  # fmt: skip
        """`head_args`: more `ray start --head` flags (e.g. --autoscaling-config). `host_address`: give the
        bridge `<subnet>.254`, so this process (outside every namespace) reaches the nodes' servers.
        `node_env`: more environment for one node's Ray (what a pod spec's env or a node's profile sets).
        `later`: nodes whose namespace is made but whose Ray starts only at `join` (a node added mid-run)."""
        self.node_env = node_env or {}
        self.later = set(later)
        self.up: set[str] = set()  # nodes whose Ray was started and not lost
        self.tag = uuid.uuid4().hex[:4]
        self.prefix = f"{prefix}{self.tag}"
        self.subnet = subnet
        self.nodes = nodes
        self.num_cpus = num_cpus
        self.head_args = list(head_args)
        self.host_address = f"{subnet}.254" if host_address else None
        self.bridge = f"{self.prefix}br"
        self.addresses = {name: f"{subnet}.{i + 1}" for i, name in enumerate(nodes)}
        self.head = next(iter(nodes))
        self.env = {
            **os.environ,
            **(env or {}),
            "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
            "RAY_AUTH_MODE": "disabled",  # a throwaway test cluster; a real one uses Ray's tokens
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.ray_root = Path(f"/tmp/{self.prefix}-ray")  # <ray_root>/<node> is that node's /tmp/ray
        self._created: list[str] = []

    def namespace(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    @property
    def head_address(self) -> str:
        return self.addresses[self.head]

    @property
    def dashboard(self) -> str:
        return f"http://{self.head_address}:8265"

    # -- network ----------------------------------------------------------------------------------------

    def _create_network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(f"link:{self.bridge}")
        _ip("link", "set", self.bridge, "up")
        if self.host_address:
            _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        for i, node in enumerate(self.nodes):
            ns, outside, inside = self.namespace(node), self._outside(node), f"{self.prefix}p{i}"
            _ip("netns", "add", ns)
            self._created.append(f"netns:{ns}")
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            self._created.append(f"link:{outside}")
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("link", "set", inside, "netns", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[node]}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
        self._static_neighbours()

    def _static_neighbours(self) -> None:
        """Every node knows every other node's MAC for good, as a cloud network's hosts do (the VPC answers
        for them): a node cut off is then silent (its packets are dropped, connections time out) instead
        of `no route to host` within seconds of a failed ARP, which no cloud partition looks like."""
        macs = {}
        for i, node in enumerate(self.nodes):
            shown = json.loads(
                _ip("-j", "-n", self.namespace(node), "link", "show", f"{self.prefix}p{i}").stdout
            )
            macs[node] = shown[0]["address"]
        for i, node in enumerate(self.nodes):
            for other in self.nodes:
                if other != node:
                    _ip("-n", self.namespace(node), "neigh", "replace", self.addresses[other], "lladdr", macs[other],
                        "dev", f"{self.prefix}p{i}", "nud", "permanent")  # fmt: skip

    # -- processes --------------------------------------------------------------------------------------

    def run(self, node: str, cmd: list[str], timeout: float = 600, check: bool = True,
            env: dict | None = None) -> subprocess.CompletedProcess:  # fmt: skip
        """Run `cmd` inside `node`'s namespace with the cluster's environment."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.namespace(node), *cmd],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=Path(__file__).resolve().parents[2],
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{cmd} in {node} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def driver_command(self, node: str, cmd: list[str]) -> list[str]:
        """`cmd` inside `node`'s namespace *and* with its Ray directory as /tmp/ray: a Ray driver there
        (jobs/serve.py, jobs/scale.py) finds the node's sockets and joins its cluster, as on that machine."""
        script = f"mount --bind {self.ray_dir(node)} /tmp/ray && exec {' '.join(map(shlex.quote, cmd))}"
        return ["ip", "netns", "exec", self.namespace(node), "sh", "-c", script]

    def run_driver(self, node: str, cmd: list[str], timeout: float = 300, check: bool = True,
                   env: dict | None = None) -> subprocess.CompletedProcess:  # fmt: skip
        done = subprocess.run(self.driver_command(node, cmd), env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout, cwd=REPO)  # fmt: skip
        if check and done.returncode != 0:
            raise RuntimeError(f"{cmd} in {node} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def start_driver(self, node: str, cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """Like run_driver, in the background, stdout and stderr to `log`. close() ends it with the rest
        (it runs inside the namespace)."""
        with open(log, "wb") as out:
            return subprocess.Popen(self.driver_command(node, cmd), env={**self.env, **(env or {})}, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=REPO)  # fmt: skip

    def ray_metrics(self, node: str) -> str:
        """`node`'s Ray metrics export page, as Prometheus scrapes it (from inside the node)."""
        url = f"http://{self.addresses[node]}:{METRICS_PORT}/metrics"
        code = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())"
        return self.run(node, ["python", "-c", code, url], timeout=60).stdout

    def ray_dir(self, node: str) -> Path:
        """What `node`'s Ray sees as /tmp/ray (its sessions, logs, unpacked working directories)."""
        return self.ray_root / node

    def _start_ray(self, nodes: list[str]) -> None:
        head = self.head_address
        for node in nodes:
            resources = self.nodes[node]
            common = [f"--node-ip-address={self.addresses[node]}", f"--num-cpus={self.num_cpus}",
                      f"--resources={json.dumps(resources)}", "--disable-usage-stats",
                      f"--metrics-export-port={METRICS_PORT}"]  # fmt: skip
            if node == self.head:
                cmd = [
                    "ray",
                    "start",
                    "--head",
                    "--port=6379",
                    "--dashboard-host=0.0.0.0",
                    *common,
                    *self.head_args,
                ]
            else:
                cmd = ["ray", "start", f"--address={head}:6379", *common]
            private = self.ray_dir(node)
            private.mkdir(parents=True, exist_ok=True)
            Path("/tmp/ray").mkdir(exist_ok=True)
            # The bind mount lives in this `ip netns exec`'s mount namespace, which Ray's daemons inherit.
            script = f"mount --bind {private} /tmp/ray && exec {' '.join(map(shlex.quote, cmd))}"
            self.run(node, ["sh", "-c", script], timeout=180, env=self.node_env.get(node))
            self.up.add(node)

    def join(self, node: str) -> None:
        """Start a `later` node's Ray: it joins the cluster (as a node an operator or autoscaler adds)."""
        self._start_ray([node])
        self.wait_for_nodes()

    def lose(self, node: str) -> list[int]:
        """The node vanishes, as a preempted spot machine does: every process in its namespace is
        SIGKILLed at once (its raylet, its workers, the vLLM servers they started). Returns their pids."""
        pids = self.pids()[node]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.pids()[node] and time.monotonic() < deadline:
            time.sleep(0.2)
        self.up.discard(node)
        return pids

    def cut(self, node: str) -> None:
        """The node cut off the network: its link to the bridge goes down, and every packet to or from it is
        lost (nothing is refused: a connection just hears nothing, see _static_neighbours), while its
        processes run on. `restore` undoes it."""
        _ip("link", "set", self._outside(node), "down")

    def restore(self, node: str) -> None:
        _ip("link", "set", self._outside(node), "up")

    def _outside(self, node: str) -> str:
        return f"{self.prefix}v{list(self.nodes).index(node)}"

    def wait_for_nodes(self, timeout_s: float = 180) -> None:
        # Through the dashboard: a driver here would look for the head's sockets in a /tmp/ray it cannot see.
        code = ("import sys; from ray.util.state import list_nodes; "
                "print(sum(n.state == 'ALIVE' for n in list_nodes(address=sys.argv[1])))")  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            alive = self.run(self.head, ["python", "-c", code, self.dashboard], check=False)
            if alive.returncode == 0 and alive.stdout.strip().splitlines()[-1] == str(len(self.up)):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {alive.stdout.strip()} of {len(self.up)} Ray nodes alive")
            time.sleep(2)

    def pids(self) -> dict[str, list[int]]:
        """Processes inside each namespace, by `ip netns pids`."""
        out = {}
        for node in self.nodes:
            listed = _ip("netns", "pids", self.namespace(node), check=False).stdout.split()
            out[node] = [int(p) for p in listed if int(p) != os.getpid()]
        return out

    def vllm_pids(self) -> dict[str, list[int]]:
        """vLLM server processes (API server, engine core, workers) inside each namespace."""
        found = {}
        for node, pids in self.pids().items():
            for pid in pids:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    comm = Path(f"/proc/{pid}/comm").read_text()
                except OSError:
                    continue
                if b"vllm.entrypoints" in cmdline or comm.startswith("VLLM::"):
                    found.setdefault(node, []).append(pid)
        return found

    def _end_processes(self) -> None:
        # Ray's GCS and raylets outlast a SIGTERM by far more than 10 s: a short grace, then SIGKILL.
        for sig, wait_s in ((signal.SIGTERM, 3), (signal.SIGKILL, 10)):
            for pids in self.pids().values():
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while any(self.pids().values()) and time.monotonic() < deadline:
                time.sleep(0.5)
            if not any(self.pids().values()):
                return

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> NamespaceCluster:
        try:
            self._create_network()
            self._start_ray([node for node in self.nodes if node not in self.later])
            self.wait_for_nodes()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> dict[str, list[int]]:
        """End everything; returns processes that survived (should be none)."""
        self._end_processes()
        survivors = {node: pids for node, pids in self.pids().items() if pids}
        for item in reversed(self._created):
            kind, name = item.split(":", 1)
            if kind == "link":
                _ip("link", "del", name, check=False)
            else:
                _ip("netns", "del", name, check=False)
        self._created.clear()
        try:
            if RAY_ADDRESS_FILE.read_text().strip().startswith(self.head_address):
                RAY_ADDRESS_FILE.unlink()
        except OSError:
            pass
        # A survivor may still write there: leave it for the report (and RLC_KEEP_RAY_DIRS keeps it to read).
        if not survivors and not os.environ.get("RLC_KEEP_RAY_DIRS"):
            shutil.rmtree(self.ray_root, ignore_errors=True)
        return survivors

    def namespaces_left(self) -> list[str]:
        listed = _ip("netns", "list", check=False).stdout.split("\n")
        return [line.split()[0] for line in listed if line.startswith(self.prefix)]

    def links_left(self) -> list[str]:
        return [
            line for line in _ip("-o", "link", "show", check=False).stdout.splitlines() if self.prefix in line
        ]

    def __enter__(self) -> NamespaceCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        """Ends everything, and fails when anything outlived it: a process, a namespace or a link."""
        survivors = self.close()
        assert not survivors, f"processes left in the namespaces: {survivors}"
        assert not self.namespaces_left() and not self.links_left()
