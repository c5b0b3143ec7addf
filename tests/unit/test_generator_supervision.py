"""The generator actor's care of its vLLM server (rl_cluster.generator.actor.Generator), with a stand-in
server and proxy. Its supervision goes on whatever one round raises: it once ended silently on a
malformed /metrics page, or when the proxy it reports to was itself restarting, and the replica's server
was never restarted again (reliability review L3). A start that fails stops the server it made: a start
asked again once left the first one running beside the second, holding its port and, on a GPU, its
memory (L2)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from rl_cluster.config import load_config
from rl_cluster.core.restarts import RestartBudget
from rl_cluster.core.telemetry import PrefixCacheCounts
from rl_cluster.generator import actor as generator_actor
from rl_cluster.generator.actor import Generator


class Process:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


class Server:
    """Dead at first (exited with 1); alive once started again."""

    def __init__(self):
        self.process, self.starts, self.stops = Process(1), 0, 0

    def stop(self):
        self.stops += 1

    def start(self):
        self.starts += 1
        self.process = Process(None)

    async def wait_healthy(self, timeout_s):
        return None


class Call:
    def __init__(self, calls: list, name: str, error: Exception | None):
        self.calls, self.name, self.error = calls, name, error

    async def _answer(self, *args):
        self.calls.append((self.name, *args))
        if self.error is not None:
            raise self.error

    def remote(self, *args):
        return self._answer(*args)


class Proxy:
    """Restarting: report_down fails as a call to a dead actor does; report_back reaches its new life."""

    def __init__(self):
        self.calls: list = []
        self.report_down = Call(self.calls, "report_down", ray.exceptions.RayActorError())
        self.report_back = Call(self.calls, "report_back", None)


def a_generator(rounds_before_stop: int) -> Generator:
    generator = Generator.__new__(Generator)
    generator.replica_id, generator.config = "g0", load_config(None, ["run_name=t"])
    generator.restarts, generator.server, generator.proxy = RestartBudget(3, 0.0), Server(), Proxy()
    generator.loaded, generator.held_before_restart = {"t-v3": "/b/t-v3"}, {}
    generator.prefix_cache, generator.spent, generator._stopping = PrefixCacheCounts(), False, False
    exports, checks = [], []

    async def export_metrics():
        exports.append(1)
        raise ValueError("malformed /metrics page")

    async def healthy():
        checks.append(1)
        generator._stopping = len(checks) >= rounds_before_stop
        return True

    generator._export_metrics, generator._healthy = export_metrics, healthy
    generator.exports, generator.checks = exports, checks
    return generator


@pytest.fixture(autouse=True)
def no_wait(monkeypatch):
    monkeypatch.setattr(generator_actor, "SUPERVISE_INTERVAL_S", 0.0)


def test_a_restart_goes_on_when_the_proxy_cannot_be_told_and_a_malformed_metrics_page_ends_nothing():
    generator = a_generator(rounds_before_stop=7)
    asyncio.run(asyncio.wait_for(generator._supervise(), 10))
    # The dead server was restarted although report_down failed, once (the budget counts one restart).
    assert (generator.server.stops, generator.server.starts, generator.restarts.used) == (1, 1, 1)
    assert [c[0] for c in generator.proxy.calls] == ["report_down", "report_back"]
    assert generator.held_before_restart == {} and not generator.spent  # the proxy caught it up
    # Supervision went on for every round after the restart, exporting (and failing to) every 3rd round.
    assert len(generator.checks) == 7 and len(generator.exports) >= 3


def test_a_replica_the_proxy_was_not_told_about_reports_what_it_held_until_caught_up():
    generator = a_generator(rounds_before_stop=2)
    generator.proxy.report_back = Call(generator.proxy.calls, "report_back", ray.exceptions.RayActorError())
    asyncio.run(asyncio.wait_for(generator._supervise(), 10))
    assert generator.server.starts == 1
    # The restored proxy catches it up from what its crashed server held (membership reports it).
    assert generator.held_before_restart == {"t-v3": "/b/t-v3"}


class Session:
    closed = False

    async def close(self):
        self.closed = True


def test_a_start_that_failed_after_its_server_came_up_stops_that_server():
    generator = a_generator(rounds_before_stop=1)
    server, session = Server(), Session()

    async def start_then_fail(replica_index, proxy):
        generator.server, generator._session = server, session
        raise RuntimeError("the proxy refused the registration")

    generator._start, generator._began, generator.vllm = start_then_fail, False, None
    with pytest.raises(RuntimeError, match="refused the registration"):
        asyncio.run(generator.start(0, proxy=None))
    assert (server.stops, session.closed, generator.server, generator._began) == (1, True, None, False)
