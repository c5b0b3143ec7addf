"""Adapter-version bookkeeping across replicas: what is loaded where, what may be routed, what may go.

Pure logic (no HTTP, Ray or vLLM). The proxy calls it around every load, unload and request; the rules:
- A replica's life: `joining` (registered) -> `catching_up` (loading every live adapter) -> `active`
  -> `draining` (being removed: no new requests, in-flight ones finish) -> gone (forgotten).
  An active replica that fails a health check becomes `unhealthy`: out of routing and of broadcasts at
  once. When it answers again it goes back through `catching_up` (it may have restarted and lost its
  adapters) to `active`. Only active replicas take new requests or count for routability.
- An adapter name is routable once it was published: loaded and confirmed on every active replica.
- Closing a name (an unload request) stops new requests for it at once; each replica unloads it when
  its in-flight count for that name reaches zero, so no running generation loses its adapter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Set
from enum import StrEnum

from rl_cluster.core.loads import LoadOrder


class ReplicaState(StrEnum):
    JOINING = "joining"
    CATCHING_UP = "catching_up"
    ACTIVE = "active"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


class VersionBook:
    """Who has which adapter, which names are routable, and in-flight counts per (replica, model)."""

    def __init__(self) -> None:
        self._state: dict[str, ReplicaState] = {}
        self._loaded: dict[str, set[str]] = {}
        self._ever_loaded: dict[str, set[str]] = {}
        self._paths: dict[str, str] = {}  # published name -> path, for replicas that join later
        self._closed: set[str] = set()
        self._holders: dict[str, set[str]] = {}  # adapter -> replicas that loaded it (the _loaded index)
        self._in_flight: Counter[tuple[str, str]] = Counter()
        # Per replica: in flight, served, capacity; the active ones in load order (routing reads it).
        self.loads = LoadOrder()
        self._active: list[str] | None = None  # sorted active ids, kept until a state changes
        self._eligible: dict[str, frozenset[str]] = {}  # adapter -> active holders, kept until one changes

    def _set_state(self, replica_id: str, state: ReplicaState) -> None:
        self._state[replica_id] = state
        self.loads.set_routable(replica_id, state is ReplicaState.ACTIVE)
        self._active = None
        self._eligible.clear()

    # -- replicas -------------------------------------------------------------------------------------

    def add_replica(
        self, replica_id: str, ever_loaded: set[str] = frozenset(), served: int = 0, down: bool = False
    ) -> None:
        """`ever_loaded`, `served`: what an earlier life of the replica loaded and was sent (its server was
        replaced). `down`: registered unhealthy (a replica a restarted proxy could not reach: the health
        watch catches it up when it answers)."""
        if replica_id in self._state:
            raise ValueError(f"replica {replica_id!r} is already registered")
        self.loads.add(replica_id, served=served)
        self._set_state(replica_id, ReplicaState.UNHEALTHY if down else ReplicaState.JOINING)
        self._loaded[replica_id] = set()
        self._ever_loaded[replica_id] = set(ever_loaded)

    def activate(self, replica_id: str) -> None:
        """The replica caught up: it must hold every routable adapter before it may take traffic."""
        state = self._state[replica_id]
        if state not in (ReplicaState.JOINING, ReplicaState.CATCHING_UP):
            raise ValueError(f"replica {replica_id!r} is {state}: it cannot become active")
        missing = self.routable() - self._loaded[replica_id]
        if missing:
            raise ValueError(f"replica {replica_id!r} cannot become active: it lacks {sorted(missing)}")
        self._set_state(replica_id, ReplicaState.ACTIVE)

    def begin_catch_up(self, replica_id: str) -> None:
        """A joining replica starts loading the live adapters, or an unhealthy one answers again."""
        state = self._state[replica_id]
        if state not in (ReplicaState.JOINING, ReplicaState.UNHEALTHY):
            raise ValueError(f"replica {replica_id!r} is {state}: only joining or unhealthy ones catch up")
        self._set_state(replica_id, ReplicaState.CATCHING_UP)

    def mark_unhealthy(self, replica_id: str) -> bool:
        """Take a failing replica out of routing; True if that changed its state. A draining replica stays
        draining (it is leaving anyway), and an unknown one (already gone) is ignored."""
        if self._state.get(replica_id) not in (ReplicaState.ACTIVE, ReplicaState.CATCHING_UP):
            return False
        self._set_state(replica_id, ReplicaState.UNHEALTHY)
        return True

    def drain(self, replica_id: str) -> None:
        self._set_state(replica_id, ReplicaState.DRAINING)

    def remove_replica(self, replica_id: str) -> None:
        self._active = None
        self._eligible.clear()
        for name in self._loaded.get(replica_id, ()):
            self._holders[name].discard(replica_id)
        for table in (self._state, self._loaded, self._ever_loaded):
            table.pop(replica_id, None)
        for key in [k for k in self._in_flight if k[0] == replica_id]:
            del self._in_flight[key]
        self.loads.remove(replica_id)
        self._forget_fully_unloaded()

    def state(self, replica_id: str) -> ReplicaState:
        return self._state[replica_id]

    def replicas(self) -> list[str]:
        return sorted(self._state)

    def active(self) -> list[str]:
        # Asked on every request (routing) and changed only by joins, failures and leaves: cached.
        if self._active is None:
            self._active = sorted(r for r, s in self._state.items() if s is ReplicaState.ACTIVE)
        return list(self._active)

    def in_state(self, *states: ReplicaState) -> list[str]:
        return sorted(r for r, s in self._state.items() if s in states)

    # -- adapters -------------------------------------------------------------------------------------

    def mark_loaded(self, replica_id: str, name: str) -> None:
        self._loaded[replica_id].add(name)
        self._ever_loaded[replica_id].add(name)
        self._holders.setdefault(name, set()).add(replica_id)
        self._eligible.pop(name, None)

    def mark_unloaded(self, replica_id: str, name: str) -> None:
        if replica_id in self._loaded:
            self._loaded[replica_id].discard(name)
            self._holders.get(name, set()).discard(replica_id)
            self._eligible.pop(name, None)
        self._forget_fully_unloaded()

    def publish(self, name: str, path: str) -> None:
        """Make `name` routable; every active replica must have confirmed it."""
        missing = [r for r in self.active() if name not in self._loaded[r]]
        if missing:
            raise ValueError(f"adapter {name!r} is not loaded on {missing}")
        if name in self._closed:
            raise ValueError(f"adapter {name!r} is being unloaded")
        self._paths[name] = path

    def known(self, name: str) -> bool:
        """Published, or loaded on some replica (maybe closed and draining): the name is taken."""
        return name in self._paths or bool(self._holders.get(name))

    def is_routable(self, name: str) -> bool:
        return name in self._paths and name not in self._closed

    def routable(self) -> set[str]:
        return set(self._paths) - self._closed

    def live_adapters(self) -> dict[str, str]:
        """Routable names and their paths: what a joining replica must load before it takes traffic."""
        return {name: path for name, path in self._paths.items() if name not in self._closed}

    def loaded_on(self, replica_id: str) -> set[str]:
        return set(self._loaded[replica_id])

    def ever_loaded_on(self, replica_id: str) -> set[str]:
        return set(self._ever_loaded[replica_id])

    def holders(self, name: str) -> list[str]:
        return sorted(self._holders.get(name, ()))

    def eligible(self, model: str | None) -> Set[str]:
        """Active replicas that may serve `model` (None: the base model, which every replica serves). Read
        only: for the base model it is a live view of the active ones. Set operations in C: routing asks on
        every request, and a Python pass over 256 replicas cost more than the rest of the request."""
        if model is None:
            return self.loads.routable_ids()
        if not self.is_routable(model):
            return frozenset()
        eligible = self._eligible.get(model)
        if eligible is None:  # asked on every request, changed by loads, unloads and state changes: kept
            eligible = self._eligible[model] = frozenset(
                self._holders.get(model, ()) & self.loads.routable_ids()
            )
        return eligible

    def close(self, name: str) -> list[str]:
        """Stop routing `name`; returns the replicas that can unload it right away (nothing in flight)."""
        if not self.known(name):
            raise KeyError(name)
        self._closed.add(name)
        return [r for r in self.holders(name) if self._in_flight[(r, name)] == 0]

    def is_closed(self, name: str) -> bool:
        return name in self._closed

    def _forget_fully_unloaded(self) -> None:
        for name in [n for n in self._closed if not self._holders.get(n)]:
            self._closed.discard(name)
            self._paths.pop(name, None)
            self._holders.pop(name, None)

    # -- in-flight ------------------------------------------------------------------------------------

    def begin(self, replica_id: str, model: str) -> None:
        self._in_flight[(replica_id, model)] += 1
        self.loads.begin(replica_id)

    def end(self, replica_id: str, model: str) -> bool:
        """A request finished. True when `model` is a closed adapter that this replica should unload now."""
        if replica_id not in self._state:
            return False  # removed while the request ran (forced removal after a drain timeout)
        key = (replica_id, model)
        if self._in_flight[key] <= 0:
            raise ValueError(f"no request for {model!r} in flight on {replica_id!r}")
        self._in_flight[key] -= 1
        self.loads.end(replica_id)
        if self._in_flight[key] == 0:
            del self._in_flight[key]
            return model in self._closed and model in self._loaded.get(replica_id, ())
        return False

    def in_flight(self, replica_id: str, model: str | None = None) -> int:
        if model is None:
            return self.loads.in_flight(replica_id)
        return self._in_flight[(replica_id, model)]
