"""The CPU cores a replica's vLLM workers are bound to: cores of their own on the replica's node.

A node runs several replicas (`generator: K`), and Ray hands out custom resources by amount, not by index,
so nothing tells a replica which of its node's cores are free; a core chosen from the replica's global slot
(`replica_index x TP`) can be one another replica of the same node holds. So each replica claims its cores
on its node: an exclusive `flock` on a file per core, in a directory of the node's own (the system's temp
directory: two runs on one node avoid each other too), held by the generator actor for its life and
released by the kernel however the actor ends (a SIGKILL included). A replica that finds fewer free cores
than it has tensor-parallel ranks shares the rest, chosen from its slot as before, and says so.

Held by the actor, not by its vLLM server: between an actor's death and its watchdog ending the server (a
few seconds) a new replica may claim those cores and share them with the dying server for that while.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rl_cluster.config import GeneratorConfig

LOCK_DIR = Path(tempfile.gettempdir()) / "rl_cluster-cores"


def shared_cores(available: Sequence[int], claimed: Sequence[int], count: int, slot: int) -> tuple[int, ...]:
    """`count` more cores for a replica that claimed `claimed` and found no more free: the unclaimed ones
    from its slot onwards (replica i's ranks from i x ranks, modulo the node's cores), as every replica
    chose before claims, else its own again (more ranks than the node has cores).

    >>> shared_cores([0, 1, 2, 3], [], 2, slot=1)
    (2, 3)
    >>> shared_cores([0, 1], [1], 1, slot=0)
    (0,)
    >>> shared_cores([0, 1], [0, 1], 1, slot=0)
    (0,)
    """
    rest = [core for core in available if core not in claimed] or list(available)
    ranks = len(claimed) + count
    return tuple(rest[(slot * ranks + rank) % len(rest)] for rank in range(count))


@dataclass
class CoreClaim:
    """The cores one replica binds its ranks to (`cores`, one per rank), of which `shared` were not free."""

    cores: tuple[int, ...]
    shared: tuple[int, ...] = ()
    _locks: list[int] = field(default_factory=list, repr=False)

    def describe(self) -> str:
        text = f"cores {'|'.join(map(str, self.cores))}"
        return text + (
            f" (sharing {list(self.shared)}: no other core of this node was free)" if self.shared else ""
        )

    def release(self) -> None:
        """Free the cores: the claim holds none afterwards (a placement read later lists none)."""
        for fd in self._locks:
            os.close(fd)  # closing the only descriptor of the file releases its flock
        self._locks.clear()
        self.cores, self.shared = (), ()


def claim_cores(
    ranks: int, slot: int, available: Sequence[int] | None = None, lock_dir: Path = LOCK_DIR
) -> CoreClaim:
    """Claim one free core per rank among `available` (default: those this process may run on), lowest
    first; ranks that find none share cores (`shared_cores`). Release it with `release()`, or by exiting."""
    available = sorted(os.sched_getaffinity(0)) if available is None else list(available)
    lock_dir.mkdir(parents=True, exist_ok=True)
    claimed: list[int] = []
    locks: list[int] = []
    for core in available:
        if len(claimed) == ranks:
            break
        fd = os.open(lock_dir / f"core-{core}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another replica's (or another run's) on this node
            os.close(fd)
            continue
        claimed.append(core)
        locks.append(fd)
    shared = shared_cores(available, claimed, ranks - len(claimed), slot) if len(claimed) < ranks else ()
    return CoreClaim(tuple(claimed) + shared, shared, locks)


def replica_cores(generator: GeneratorConfig, slot: int, replica_id: str) -> CoreClaim:
    """The cores of a replica of `generator` in `slot`, claimed and said; none (unbound) on GPUs or where
    `generator.pin_cpu_cores` is off."""
    if not generator.pin_cpu_cores or generator.num_gpus:
        return CoreClaim(())
    claim = claim_cores(generator.tensor_parallel_size, slot)
    print(f"replica {replica_id}: vLLM's workers on {claim.describe()}", flush=True)
    return claim
