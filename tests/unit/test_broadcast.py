"""All-or-nothing over the replicas that are up: the broadcast's rules, with in-memory replicas."""

from __future__ import annotations

import asyncio

import pytest

from rl_cluster.errors import (
    AdapterError,
    AdapterNotFound,
    AdapterRejected,
    ReplicaDown,
    ReplicaServerError,
    ReplicaTimeout,
)
from rl_cluster.proxy.broadcast import LoadFailed, load_everywhere, load_with_retry


class Replica:
    def __init__(self, fails_with: Exception | None = None):
        self.fails_with = fails_with
        self.adapters: set[str] = set()

    async def load_adapter(self, name: str, path: str) -> None:
        if self.fails_with is not None:
            raise self.fails_with
        self.adapters.add(name)

    async def unload_adapter(self, name: str) -> None:
        self.adapters.discard(name)


async def broadcast(replicas: dict[str, Replica], dead: set[str]):
    loaded: list[str] = []
    asked: list[str] = []

    async def down(replica_id, error):
        asked.append(replica_id)
        return replica_id in dead

    await load_everywhere(
        "run-v2", "/bucket/run-v2", replicas, retry_s=0.01, deadline_s=0.05,
        loaded=loaded.append, holders=lambda: list(loaded), unloaded=loaded.remove, down=down,
    )  # fmt: skip
    return loaded, asked


async def test_a_replica_that_is_down_is_left_out_and_the_load_succeeds():
    replicas = {"g0": Replica(), "g1": Replica(AdapterError("replica unreachable")), "g2": Replica()}
    loaded, asked = await broadcast(replicas, dead={"g1"})
    assert sorted(loaded) == ["g0", "g2"] and asked == ["g1"]
    assert replicas["g0"].adapters == replicas["g2"].adapters == {"run-v2"}


async def test_a_healthy_replica_that_fails_rolls_the_load_back():
    replicas = {"g0": Replica(), "g1": Replica(AdapterError("HTTP 500"))}
    with pytest.raises(LoadFailed) as failed:
        await broadcast(replicas, dead=set())
    assert failed.value.status == 502 and replicas["g0"].adapters == set()
    assert not failed.value.all_down


async def test_a_refused_adapter_fails_whatever_the_replicas_health():
    replicas = {"g0": Replica(), "g1": Replica(AdapterRejected("sha256 mismatch"))}
    with pytest.raises(LoadFailed) as failed:
        await broadcast(replicas, dead={"g1"})
    assert failed.value.status == 400 and "sha256 mismatch" in str(failed.value)
    assert replicas["g0"].adapters == set()


async def test_when_every_replica_is_down_the_load_fails_saying_so():
    replicas = {"g0": Replica(AdapterError("unreachable")), "g1": Replica(AdapterError("unreachable"))}
    with pytest.raises(LoadFailed, match="unreachable") as failed:
        await broadcast(replicas, dead={"g0", "g1"})
    assert failed.value.all_down  # the proxy waits for a replica to return instead of failing the sync
    # One down and one failing for real is a real failure.
    with pytest.raises(LoadFailed) as failed:
        await broadcast(replicas, dead={"g0"})
    assert not failed.value.all_down


async def test_a_5xx_is_the_replicas_failure_when_it_is_down_and_a_refusal_when_it_is_up():
    # vLLM answers both a dead engine core and a rank above --max-lora-rank with a 500.
    refused = {"g0": Replica(), "g1": Replica(ReplicaServerError("HTTP 500: LoRA rank 64 > max 8"))}
    with pytest.raises(LoadFailed) as failed:
        await broadcast(refused, dead=set())
    assert failed.value.status == 400 and refused["g0"].adapters == set()
    broken = {"g0": Replica(), "g1": Replica(ReplicaServerError("HTTP 500: EngineCore encountered an issue"))}
    loaded, asked = await broadcast(broken, dead={"g1"})
    assert loaded == ["g0"] and asked == ["g1"]


class Hung(Replica):
    """A replica that never answers (a stopped process, a stalled mount): each call waits for ever."""

    def __init__(self, not_found_first: int = 0):
        super().__init__()
        self.not_found_first = not_found_first

    async def load_adapter(self, name: str, path: str) -> None:
        if self.not_found_first:
            self.not_found_first -= 1
            raise AdapterNotFound("no manifest yet")
        await asyncio.Event().wait()


async def test_a_replica_that_misses_the_deadline_is_down_and_the_sync_goes_on_without_it():
    replicas = {"g0": Replica(), "g1": Hung()}
    errors: dict[str, BaseException] = {}

    async def down(replica_id, error):
        errors[replica_id] = error
        return isinstance(error, ReplicaDown)

    loaded: list[str] = []
    await asyncio.wait_for(
        load_everywhere(
            "run-v2",
            "/bucket/run-v2",
            replicas,
            retry_s=0.01,
            deadline_s=0.2,
            loaded=loaded.append,
            holders=lambda: list(loaded),
            unloaded=loaded.remove,
            down=down,
        ),  # fmt: skip
        5,  # without the deadline the load would wait for the hung replica for ever
    )
    assert loaded == ["g0"] and replicas["g0"].adapters == {"run-v2"}
    assert isinstance(errors["g1"], ReplicaTimeout) and "load_deadline_s=0.2" in str(errors["g1"])


async def test_a_replica_that_answered_not_found_then_hangs_reports_the_adapter_missing():
    with pytest.raises(AdapterNotFound):
        await asyncio.wait_for(
            load_with_retry(
                Hung(not_found_first=1), "run-v2", "/p", retry_s=0.01, deadline_s=0.2, give_up=asyncio.Event()
            ),  # fmt: skip
            5,
        )


async def test_an_unreachable_actor_takes_its_replica_out_of_routing_without_asking_its_server():
    """A load through a generator actor Ray cannot reach (ActorUnavailableError: cut off, or just back and
    not reconnected yet) fails on that replica only: it leaves routing, named unreachable rather than
    dead, and its server's /health (which may answer fine) is not the judge."""
    from rl_cluster.config import ProxyConfig
    from rl_cluster.core.versions import ReplicaState, VersionBook
    from rl_cluster.errors import ReplicaUnreachable
    from rl_cluster.proxy.health import HealthWatch
    from rl_cluster.proxy.replica import Replica

    book = VersionBook()
    book.add_replica("g1")
    book.activate("g1")
    replicas = {"g1": Replica("g1", "http://127.0.0.1:9", loader=None)}
    watch = HealthWatch(ProxyConfig(), replicas, book, spawn=None, catch_up_again=None)

    async def healthy(replica):
        return None

    watch.probe = healthy
    error = ReplicaUnreachable("Ray cannot reach its generator actor (ActorUnavailableError)")
    assert await watch.is_down("g1", error)
    assert book.state("g1") is ReplicaState.UNHEALTHY
    assert watch.down_reasons["g1"] == (
        "ReplicaUnreachable: Ray cannot reach its generator actor (ActorUnavailableError); "
        "health check: its actor is out of reach"
    )
