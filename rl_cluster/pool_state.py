"""What a pool controller Ray restarted takes over from the one that died: its record, kept in Ray's GCS,
and the run's generators, found by name.

The generators are detached actors named in rl_cluster.core.names.NAMESPACE, so they outlive the pool
controller that started them (an actor's children die with it otherwise, and with them the run's whole
generation). Each round the controller keeps its record (scale events, where each replica ran and the
faults it came through, the policy's windows and manual target, the replacements it granted, the replica
numbering) in Ray's internal key-value store, as Ray Serve's controller checkpoints its own state there;
a restarted controller reads it back and adopts every generator of the run that is still alive. At most
one round of the record (generator.scale_interval_s) is lost with the dead process.

The run's driver stops the generators by name as well as by handle (`stop_generators`): when its run ends,
and before it starts any, since a driver that was killed (SIGKILL, its node lost) left its generators
running and the next driver of the run (`--resume`) gives its own the same names.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from dataclasses import dataclass, field

import ray
from ray.experimental import internal_kv

from rl_cluster.core.names import NAMESPACE, generator_actor_name, replica_number, replica_of
from rl_cluster.core.replacement import Replacements
from rl_cluster.core.replica_history import ReplicaHistory
from rl_cluster.core.scaling import ScaleEvent, ScalingPolicy

KV_NAMESPACE = "rl_cluster"


@dataclass(frozen=True)
class Leaving:
    """A replica on its way out, as a successor must finish taking it out: drained, then stopped, under
    scale event `event` (an index into the record's events) with `why` in its history, its drain bounded
    by wall clock `until` (None: generator.drain_timeout_s) and stopped whatever the drain says when
    `stop_anyway` (its node is going); or, with `event` None, only stopped (its restart budget is spent)."""

    why: str
    event: int | None = None
    until: float | None = None
    stop_anyway: bool = False


@dataclass
class PoolRecord:
    policy: ScalingPolicy
    replacements: Replacements
    history: ReplicaHistory
    events: list[ScaleEvent] = field(default_factory=list)
    restarts_seen: dict[str, int] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)  # replica -> the slot that picks its CPU core
    next_index: int = 0  # the next replica is g<next_index>
    leaving: dict[str, Leaving] = field(default_factory=dict)  # replica -> its way out, under way
    proxy_restores: int = 0
    restarts: int = 0  # of the pool controller itself
    kept_at: float = 0.0  # wall clock of the keep: a restarted controller's predecessor died after it


@dataclass(frozen=True)
class Restarts:
    """How often Ray restarted the run's proxy and its pool controller (summary.json; None: unknown)."""

    proxy: int | None
    pool: int | None


def _key(run_name: str, job_id: str) -> str:
    # A job's own: a --resume driver's controller never takes over a killed driver's record.
    return f"pool/{run_name}/{job_id}"


class RecordKeeper:
    """Keeps one job's pool record in the GCS (a few KB, once a round). `in_memory()`: one that keeps it in
    this process (a controller outside Ray, in a unit test)."""

    def __init__(self, run_name: str, job_id: str, store: dict[str, bytes] | None = None):
        self.run_name, self.key = run_name, _key(run_name, job_id)
        self._store = store

    @classmethod
    def in_memory(cls, run_name: str = "run") -> RecordKeeper:
        return cls(run_name, "local", store={})

    def keep(self, record: PoolRecord) -> None:
        record.kept_at = time.time()
        data = pickle.dumps(record)
        if self._store is not None:
            self._store[self.key] = data
        else:
            internal_kv._internal_kv_put(self.key, data, overwrite=True, namespace=KV_NAMESPACE)

    def recall(self) -> PoolRecord | None:
        if self._store is not None:
            data = self._store.get(self.key)
        else:
            data = internal_kv._internal_kv_get(self.key, namespace=KV_NAMESPACE)
        return None if data is None else pickle.loads(data)

    def forget_run(self) -> None:
        """Every record of the run, this job's and those of drivers that died before it."""
        if self._store is not None:
            self._store.clear()
        else:
            internal_kv._internal_kv_del(f"pool/{self.run_name}/", del_by_prefix=True, namespace=KV_NAMESPACE)


def running_generators(run_name: str) -> dict[str, object]:
    """Replica id -> handle of each generator actor of `run_name` that Ray knows alive, by name."""
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        replica = replica_of(run_name, entry["name"]) if entry["namespace"] == NAMESPACE else None
        if replica is not None:
            try:
                found[replica] = ray.get_actor(entry["name"], namespace=NAMESPACE)
            except ValueError:  # gone since the listing
                continue
    return found


def record_of(pool) -> PoolRecord:
    """A pool controller's (rl_cluster.pool.PoolController) record, as of now."""
    c = pool.cluster
    return PoolRecord(pool.policy, pool.replacements, c.history, pool.events, c.restarts_seen, c._slots,
                      c._next_index, dict(pool._leaving), pool.proxy_restores, pool.restarts)  # fmt: skip


def take_over(pool, record: PoolRecord) -> list[str]:
    """Make a restarted controller what its predecessor was: the record, and the run's generators alive now,
    found by name, in its copy of the Cluster (its constructor's, as it was at launch): the record's and any
    started after it was kept. Returns those the record did not know (see `locate`)."""
    pool.policy, pool.replacements, pool.events = record.policy, record.replacements, record.events
    pool.proxy_restores, pool.restarts = record.proxy_restores, record.restarts + 1
    cluster = pool.cluster
    cluster.history, cluster.restarts_seen = record.history, record.restarts_seen
    cluster._slots, cluster._next_index = record.slots, record.next_index
    cluster.generators = running_generators(cluster.config.run_name)
    cluster._next_index = max([cluster._next_index, *(replica_number(r) + 1 for r in cluster.generators)])
    took = time.time() - record.kept_at  # the predecessor died after that keep
    cluster.history.record("pool", "pool controller restarted by Ray", record.kept_at, took)
    print(f"pool: restarted by Ray; took over {sorted(cluster.generators)} and the record kept {took:.1f} s "
          "ago", flush=True)  # fmt: skip
    return [r for r in cluster.generators if r not in cluster._slots or cluster.history.current(r) is None]


async def locate(cluster, replicas: list[str], timeout_s: float = 10.0) -> None:
    """Where each of `replicas` runs and the slot its server was started with, asked of its actor; one
    that does not answer (pending: no node yet) is left be, and the pool's next rounds look at it."""
    for rid in replicas:
        actor = cluster.generators.get(rid)
        try:
            condition = await asyncio.wait_for(actor.condition.remote(), timeout_s)
            if condition.slot is not None:
                cluster._slots[rid] = condition.slot
            await asyncio.wait_for(cluster._placed(rid, actor), timeout_s)
        except Exception:  # noqa: BLE001
            continue


async def finish_leaving(pool, rid: str, left: Leaving) -> None:
    """Take out again a replica the predecessor was taking out when it died: its drain may have begun (the
    proxy's drain of a draining replica waits for what is still in flight), its server may still run.
    Left alone, the proxy would keep it out of routing and the policy would not count it, for the rest
    of the run, with its vLLM server up."""
    pool._leaving[rid] = left
    if left.event is None:
        await pool._retire(rid)
        return
    budget = None if left.until is None else max(0.0, left.until - time.time())
    print(f"pool: {rid} was leaving ({left.why}) when the controller died; it leaves now", flush=True)
    try:
        await pool._shrink(rid, pool.events[left.event], time.monotonic(), budget, left.why, left.stop_anyway)
    finally:
        pool.replacements.done(rid)  # a replacement the predecessor had not started is the policy's now


async def stop_generators(run_name: str, timeout_s: float = 60.0) -> list[str]:
    """Kill every generator actor of `run_name` found by name (their vLLM servers' watchdogs end the
    servers), and wait, bounded, until their names are free for a new driver's generators."""
    found = await asyncio.to_thread(running_generators, run_name)
    for actor in found.values():
        ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while left := sorted(set(await asyncio.to_thread(running_generators, run_name)) & set(found)):
        if time.monotonic() > deadline:
            names = [generator_actor_name(run_name, r) for r in left]
            raise RuntimeError(f"generator actors {names} did not stop within {timeout_s:g} s of ray.kill")
        await asyncio.sleep(0.5)
    return sorted(found)


class Succession:
    """A pool controller's record kept for a successor each round, and, in a successor, taken over.

    A record of this job's controller exists from its start() on: a controller that finds one when it is
    built is a restart by Ray. It takes its predecessor's place in its constructor (no call is answered
    from the launch's copy of the Cluster) and starts itself: nobody else calls its start()."""

    def __init__(self, pool, keeper: RecordKeeper | None = None):
        # Ray is asked only inside an actor: `ray.get_runtime_context()` outside one starts a local Ray.
        if keeper is None:
            keeper = RecordKeeper(pool.cluster.config.run_name, ray.get_runtime_context().get_job_id())
        self.pool, self.keeper = pool, keeper
        self.unplaced: list[str] | None = None  # in a successor: generators the record did not know
        self.leaving: dict[str, Leaving] = {}  # in a successor: those its predecessor was taking out
        if (record := self.keeper.recall()) is not None:
            self.unplaced = take_over(pool, record)
            self.leaving = {r: left for r, left in record.leaving.items() if r in pool.cluster.generators}
            ray.get_runtime_context().current_actor.start.remote()

    async def begin(self) -> None:
        if self.unplaced is None:
            self.keeper.forget_run()  # records of the run's earlier drivers, killed before their end
        else:
            await locate(self.pool.cluster, self.unplaced)
            for rid, left in self.leaving.items():
                self.pool._spawn(finish_leaving(self.pool, rid, left))
        self.keep()

    def keep(self) -> None:
        self.keeper.keep(record_of(self.pool))

    def end(self) -> None:
        self.keeper.forget_run()
