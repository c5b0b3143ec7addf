"""The replicas' loads, kept in routing order as requests begin and end.

Routing asks, for every request, which eligible replica is the least loaded; with a pass over all of them
that cost grew with the pool (1.3 us per replica per request in BENCHMARKS.md section 6: at 256 replicas
more than the rest of the proxy's work together). Here each replica's order key changes in O(log N) when
one of its requests begins or ends, and the least-loaded eligible replica is the first eligible one in
order, which is almost always the first.

The order is "less loaded": in-flight requests, then requests served so far (so sequential traffic
alternates), then the replica id, each count relative to the replica's capacity (concurrent sequences,
vLLM's max_num_seqs): divided by it and multiplied by the smallest known capacity, so a load is a number
of requests on the smallest replica and a replica twice as large takes about twice the traffic. Replicas
of unknown capacity count as the smallest known one; with none known (or all equal), loads are the raw
counts, exactly. Pure logic: no HTTP, Ray, vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Callable, KeysView

from sortedcontainers import SortedList

Key = tuple[float, float, str]


class LoadOrder:
    """Per replica: requests in flight, requests served, capacity; the routable ones in load order."""

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._served: dict[str, int] = {}
        self._capacity: dict[str, int] = {}  # known ones only (>= 1)
        self._keys: dict[str, Key] = {}  # routable replicas' current keys
        self._order: SortedList = SortedList()
        self.smallest = 1  # the smallest known capacity among all tracked replicas (1: none known)

    # -- membership -----------------------------------------------------------------------------------

    def add(self, replica_id: str, served: int = 0, in_flight: int = 0) -> None:
        """Track a replica (not routable yet). `served`: requests an earlier life of it was sent."""
        if replica_id in self._in_flight:
            raise ValueError(f"replica {replica_id!r} is already tracked")
        self._in_flight[replica_id], self._served[replica_id] = in_flight, served

    def remove(self, replica_id: str) -> None:
        self.set_routable(replica_id, False)
        self._in_flight.pop(replica_id, None)
        self._served.pop(replica_id, None)
        if self._capacity.pop(replica_id, None) is not None:
            self._rescale()

    def set_capacity(self, replica_id: str, capacity: int | None) -> None:
        """What the replica runs at once; None, or less than 1, is unknown."""
        if replica_id not in self._in_flight:
            return  # it left meanwhile (capacities are learnt in the background)
        if capacity is None or capacity < 1:
            self._capacity.pop(replica_id, None)
        else:
            self._capacity[replica_id] = capacity
        self._rescale()

    def set_routable(self, replica_id: str, routable: bool) -> None:
        """Routable replicas are in the order; the others keep their counts (a draining one finishes its
        requests, an unhealthy one may come back)."""
        key = self._keys.pop(replica_id, None)
        if key is not None:
            self._order.remove(key)
        if routable:
            self._place(replica_id)

    def __contains__(self, replica_id: str) -> bool:
        """Routable."""
        return replica_id in self._keys

    def __len__(self) -> int:
        """How many are routable."""
        return len(self._keys)

    # -- requests -------------------------------------------------------------------------------------

    def begin(self, replica_id: str) -> None:
        self._in_flight[replica_id] += 1
        self._served[replica_id] += 1
        self._move(replica_id)

    def end(self, replica_id: str) -> None:
        if self._in_flight.get(replica_id, 0) <= 0:
            raise ValueError(f"no request in flight on {replica_id!r}")
        self._in_flight[replica_id] -= 1
        self._move(replica_id)

    def in_flight(self, replica_id: str) -> int:
        return self._in_flight.get(replica_id, 0)

    def served(self, replica_id: str) -> int:
        return self._served.get(replica_id, 0)

    # -- asking ---------------------------------------------------------------------------------------

    def key(self, replica_id: str) -> Key:
        """A routable replica's place in the order: (relative in flight, relative served, id)."""
        return self._keys[replica_id]

    def load(self, replica_id: str) -> float:
        """Relative in-flight count: requests on the smallest replica that would load it as much."""
        return self._keys[replica_id][0]

    def routable_ids(self) -> KeysView[str]:
        """The routable replicas, as a live read-only set (set operations on it run in C)."""
        return self._keys.keys()

    def least(self, accept: Callable[[str], bool]) -> str | None:
        """The least-loaded routable replica that `accept`s (None: none does). The first one, usually."""
        for key in self._order:
            if accept(key[2]):
                return key[2]
        return None

    def fewest_served(self, accept: Callable[[str], bool]) -> str | None:
        """The accepted routable replica sent the fewest requests (relative to capacity): round robin that
        survives joins and leaves. A pass over all of them: a baseline policy, not the proxy's own."""
        accepted = [r for r in self._keys if accept(r)]
        return min(accepted, key=lambda r: self._keys[r][1:]) if accepted else None

    # -- keeping the order ----------------------------------------------------------------------------

    def _relative(self, count: int, replica_id: str) -> float:
        # One division of exact integers: equal ratios compare equal, and for a replica of the smallest
        # size (every replica, in a pool of equal ones) it is the count itself.
        return count * self.smallest / self._capacity.get(replica_id, self.smallest)

    def _place(self, replica_id: str) -> None:
        key = (
            self._relative(self._in_flight[replica_id], replica_id),
            self._relative(self._served[replica_id], replica_id),
            replica_id,
        )
        self._keys[replica_id] = key
        self._order.add(key)

    def _move(self, replica_id: str) -> None:
        key = self._keys.pop(replica_id, None)
        if key is not None:
            self._order.remove(key)
            self._place(replica_id)

    def _rescale(self) -> None:
        """The smallest capacity, and with it every relative key, after a capacity came or went (rare:
        a replica joined, left, or reported its size)."""
        self.smallest = min(self._capacity.values(), default=1)
        routable = list(self._keys)
        self._keys.clear()
        self._order.clear()
        for replica_id in routable:
            self._place(replica_id)
