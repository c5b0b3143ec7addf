"""When the generator pool grows or shrinks: pure decisions from periodic snapshots of the proxy's counts.

The pool controller (rl_cluster.pool) samples the proxy every few seconds and hands each sample to
`ScalingPolicy.observe`, which answers with what to do now, if anything:

- **grow** when demand (requests in flight per serving replica, plus any the proxy queues) stayed above
  `up_in_flight` in every sample for `up_window_s`: to as many replicas as the demand needs at
  `up_in_flight` each, all at once (a replica takes a node, a vLLM start and a catch-up to serve, minutes
  on a cloud: one at a time, a step to four times the demand took four of those; bench.pool_step).
  Replicas still starting count as capacity on its way, so the same demand is never counted twice;
- **shrink** by one when a serving replica was idle (nothing in flight, nothing new routed to it) in every
  sample for `down_window_s`; the newest of the replicas idle now goes, so the first ones keep their
  warm caches;
- never outside [min_replicas, max_replicas], and at most one automatic change per `cooldown_s`;
- a manual target (an operator's `jobs/scale.py --replicas N`) replaces all of that: the pool goes to N
  at once and stays there until the operator hands it back (`--auto`);
- an add that failed (no node came in time, vLLM did not start) holds every later add, manual and
  "below min_replicas" too, for `cooldown_s`, doubling with each failure in a row up to MAX_BACKOFF_S: a
  start that fails in seconds is not retried every sample, each time with a new actor.

Hysteresis is built in: adding a replica spreads a fixed demand thinner, but no replica becomes idle
from that, so growing never by itself triggers a shrink. Time is whatever clock the caller uses
(monotonic seconds); nothing here sleeps or reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_BACKOFF_S = 600.0  # the longest hold after adds that failed in a row


@dataclass(frozen=True)
class ScalingRules:
    min_replicas: int
    max_replicas: int
    up_in_flight: float
    """Demand above which the pool should grow: requests in flight (or queued) per serving replica."""
    up_window_s: float
    down_window_s: float
    cooldown_s: float

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 1 <= min_replicas={self.min_replicas} <= max_replicas={self.max_replicas}"
            )

    @property
    def elastic(self) -> bool:
        return self.min_replicas < self.max_replicas


@dataclass(frozen=True)
class ReplicaLoad:
    in_flight: int
    requests: int
    """Requests routed to the replica so far (a counter): unchanged between samples means nothing new
    arrived, which a sample of in_flight alone cannot tell for short requests."""


@dataclass(frozen=True)
class PoolSnapshot:
    time: float
    serving: dict[str, ReplicaLoad]
    """Replicas the proxy routes to, in the order they joined."""
    starting: int = 0
    """Replicas started but not serving yet (waiting for a node, starting vLLM, catching up)."""
    unavailable: int = 0
    """Registered replicas out of routing for now (unhealthy, restarting): they come back on their own."""
    queued: int = 0
    """Requests waiting for a replica (a proxy that bounds in-flight requests per replica may queue)."""

    @property
    def size(self) -> int:
        return len(self.serving) + self.starting + self.unavailable

    @property
    def total_demand(self) -> int:
        """Requests in flight or queued, over the whole pool."""
        return sum(r.in_flight for r in self.serving.values()) + self.queued

    @property
    def demand(self) -> float:
        """Requests in flight or queued per serving replica (infinite when requests wait and none serves)."""
        total = sum(r.in_flight for r in self.serving.values()) + self.queued
        if not self.serving:
            return math.inf if total else 0.0
        return total / len(self.serving)


@dataclass(frozen=True)
class Decision:
    add: int = 0
    remove: tuple[str, ...] = ()
    reason: str = ""


@dataclass
class ScalingPolicy:
    rules: ScalingRules
    manual_target: int | None = None
    _high_since: float | None = None
    _idle_since: dict[str, float] = field(default_factory=dict)
    _last_requests: dict[str, int] = field(default_factory=dict)
    _last_change: float = -math.inf
    _failed_adds: int = 0  # in a row
    _adds_held_until: float = -math.inf

    def add_failed(self, now: float) -> None:
        """An add decided earlier failed: hold the next adds, the longer the more failed in a row."""
        self._failed_adds += 1
        hold = min(self.rules.cooldown_s * 2 ** (self._failed_adds - 1), MAX_BACKOFF_S)
        self._adds_held_until = now + hold

    def add_succeeded(self) -> None:
        self._failed_adds, self._adds_held_until = 0, -math.inf

    def set_target(self, target: int | None) -> None:
        """Pin the pool at `target` replicas (None: back to automatic). Refused outside [min, max]."""
        r = self.rules
        if target is not None and not r.min_replicas <= target <= r.max_replicas:
            raise ValueError(
                f"{target} replicas is outside generator.min_replicas={r.min_replicas} .. "
                f"generator.max_replicas={r.max_replicas}"
            )
        self.manual_target = target
        self._high_since = None  # windows measured under the old regime say nothing about the new one
        self._idle_since.clear()

    def observe(self, snap: PoolSnapshot) -> Decision | None:
        """Take one sample; return what to do now (the caller does it before the next sample), or None."""
        self._track(snap)
        if self.manual_target is not None:
            return self._towards(snap, self.manual_target, f"manual: target {self.manual_target}")
        r = self.rules
        if snap.size < r.min_replicas:
            return self._changed(snap, Decision(add=r.min_replicas - snap.size, reason="below min_replicas"))
        if snap.time - self._last_change < r.cooldown_s:
            return None
        high_for = snap.time - self._high_since if self._high_since is not None else -1.0
        needed = min(r.max_replicas, math.ceil(snap.total_demand / r.up_in_flight))
        if high_for >= r.up_window_s and needed > snap.size:
            reason = (
                f"demand {snap.demand:.1f} in flight per replica above {r.up_in_flight:g} "
                f"for {high_for:.0f} s"
            )
            return self._changed(snap, Decision(add=needed - snap.size, reason=reason))
        if (
            self._high_since is None
            and snap.size > r.min_replicas
            and not (snap.starting or snap.unavailable)
        ):
            since = self._idle_since
            idle_long = [
                rid for rid in snap.serving if snap.time - since.get(rid, snap.time) >= r.down_window_s
            ]
            if idle_long:
                # Spare capacity: the newest replica idle now goes (maybe not the one idle longest).
                victim = [rid for rid in snap.serving if rid in since][-1]
                reason = f"{', '.join(idle_long)} idle for {snap.time - since[idle_long[0]]:.0f} s"
                return self._changed(snap, Decision(remove=(victim,), reason=reason))
        return None

    def _track(self, snap: PoolSnapshot) -> None:
        """Update how long demand has been high, and how long each replica has been idle."""
        # Replicas on their way are counted when sizing (observe), not here: the demand on those serving
        # now is what the window watches.
        if snap.demand > self.rules.up_in_flight:
            self._high_since = snap.time if self._high_since is None else self._high_since
        else:
            self._high_since = None
        for rid, load in snap.serving.items():
            new_requests = load.requests != self._last_requests.get(rid, load.requests)
            if load.in_flight or new_requests or snap.queued:
                self._idle_since.pop(rid, None)
            else:
                self._idle_since.setdefault(rid, snap.time)
        self._last_requests = {rid: load.requests for rid, load in snap.serving.items()}
        for rid in set(self._idle_since) - set(snap.serving):
            del self._idle_since[rid]

    def _towards(self, snap: PoolSnapshot, target: int, reason: str) -> Decision | None:
        """All at once: an operator who asked for N wants N, not one per cooldown."""
        if snap.size < target:
            return self._changed(snap, Decision(add=target - snap.size, reason=reason))
        if snap.size > target:
            # Only serving replicas can drain, and never below the target of them: starting ones are
            # counted and left to finish (a later sample removes the excess). Idle ones first, newest first.
            order = sorted(reversed(snap.serving), key=lambda rid: rid not in self._idle_since)
            remove = tuple(order[: max(0, len(snap.serving) - target)])
            if remove:
                return self._changed(snap, Decision(remove=remove, reason=reason))
        return None

    def _changed(self, snap: PoolSnapshot, decision: Decision) -> Decision | None:
        if decision.add and snap.time < self._adds_held_until:
            return None  # after a failed add (add_failed): the windows go on as if nothing was decided
        self._last_change = snap.time
        self._high_since = None
        self._idle_since.clear()
        return decision


@dataclass
class ScaleEvent:
    """One change of the pool, as summary.json's `scale_events` records it."""

    time: float
    """Unix time of the decision."""
    from_replicas: int
    to_replicas: int
    reason: str
    replicas: list[str] = field(default_factory=list)
    """The replicas added or removed."""
    ready_s: float | None = None
    """Scale-out: decision -> every new replica registered and caught up (a node, a vLLM start, the loads)."""
    first_request_s: float | None = None
    """Scale-out: decision -> the first request the proxy routed to a new replica."""
    drain: dict[str, dict] = field(default_factory=dict)
    """Scale-in, per replica: requests in flight when draining began and left when it ended, seconds
    draining, seconds until its server was stopped."""
    error: str | None = None

    def drained(self, replica_id: str, drain: dict, stopped_s: float) -> None:
        """Record a replica's drain (the proxy's answer; None counts where the drain failed) and stop."""
        keep = ("in_flight_at_start", "in_flight_left")
        self.drain[replica_id] = {**{k: drain.get(k) for k in keep}, "drain_s": round(drain.get("drain_s", 0.0), 3),
                                  "stopped_s": round(stopped_s, 3)}  # fmt: skip

    def as_dict(self) -> dict:
        return {
            "time": round(self.time, 3),
            "from": self.from_replicas,
            "to": self.to_replicas,
            "reason": self.reason,
            "replicas": list(self.replicas),
            "ready_s": self.ready_s,
            "first_request_s": self.first_request_s,
            "drain": dict(self.drain),
            "error": self.error,
        }


# Proxy states of a replica on its way in (registered, loading the live versions) and of one that is out
# for now but comes back by itself (its server is being restarted).
ARRIVING = ("joining", "catching_up")
OUT_FOR_NOW = ("unhealthy",)


def snapshot(
    generators, stats: dict, now: float, leaving: set[str], replacing: int
) -> tuple[PoolSnapshot, dict]:
    """The policy's view of the run's `generators`, in the order they joined (replicas the proxy has from
    elsewhere are not the pool's to count or stop), from the proxy's `stats`. `leaving`: replicas on their
    way out; `replacing`: replacements of drained replicas, counted before their actors exist."""
    proxy_view = stats.get("replicas", {})
    serving: dict[str, ReplicaLoad] = {}
    starting, out, gone = [], [], []
    for rid in generators:
        state = proxy_view.get(rid, {}).get("state")
        if rid in leaving:
            gone.append(rid)
        elif state == "active":
            serving[rid] = ReplicaLoad(proxy_view[rid]["in_flight"], proxy_view[rid]["requests"])
        elif state in OUT_FOR_NOW:
            out.append(rid)
        elif state is None or state in ARRIVING:
            starting.append(rid)  # waiting for a node, starting vLLM, or catching up
    snap = PoolSnapshot(now, serving, starting=len(starting) + replacing, unavailable=len(out),
                        queued=stats.get("queued", 0))  # fmt: skip
    return snap, {"serving": list(serving), "starting": starting, "unavailable": out, "leaving": gone}
