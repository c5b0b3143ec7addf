"""Replacing replicas whose node is going away (a preemption drain): how many, and what is recorded.

The pool controller (rl_cluster.pool) starts a replacement for a replica on a draining node at once and
drains the replica. Replacing is a recovery, and a recovery must not be what runs away: if draining
the replica fails (the proxy does not know it, a call fails), the replica is still on its node at the
next round, and without a memory of what was done the controller would start one more replacement
every round. Two bounds:

- **one replacement per lost replica**, for the run: a replica seen on a draining node again is only
  stopped, never replaced twice;
- **never past max_replicas**: the replicas that stay, plus the replacements whose actors do not exist
  yet, plus this one. Where there is no room, the replica is only drained; the policy adds a replica if
  the pool then falls below min_replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_cluster.core.scaling import ScaleEvent

# A drained replica's requests must be done this long before its node's deadline (its vLLM must stop
# and leave the proxy while the node is still there).
DRAIN_MARGIN_S = 10.0


@dataclass
class Replacements:
    max_replicas: int
    replaced: set[str] = field(default_factory=set)
    """Replicas that were given a replacement (whatever became of it): never again."""
    pending: dict[str, list[str]] = field(default_factory=dict)
    """Replica leaving -> its replacement's replica ids, once its actor exists (empty until then)."""

    def grant(self, replica_id: str, staying: int) -> bool:
        """May `replica_id` (on a draining node, leaving now) have a replacement? `staying`: the pool's
        replicas not leaving (started replacements included). True records it as pending, and the
        replica is never granted another."""
        if replica_id in self.replaced or staying + self.unstarted() + 1 > self.max_replicas:
            return False
        self.replaced.add(replica_id)
        self.pending[replica_id] = []
        return True

    def unstarted(self) -> int:
        """Replacements decided whose actors do not exist yet: the policy counts them as starting, or it
        would see a hole and add one more (once an actor exists, the pool's snapshot counts it)."""
        return sum(1 for made in self.pending.values() if not made)

    def done(self, replica_id: str) -> None:
        self.pending.pop(replica_id, None)


def evacuation(
    replica_id: str, address: str, deadline: float | None, now: float, drain_timeout_s: float, size: int,
    replace: bool,
) -> tuple[ScaleEvent, float, str]:  # fmt: skip
    """The scale event of a replica leaving its draining node (`deadline`: Unix time, None: none given),
    how long its drain may take (drain_timeout_s, and done DRAIN_MARGIN_S before the deadline), and the
    notice to log."""
    left = None if deadline is None else deadline - now
    budget = drain_timeout_s if left is None else max(0.0, min(drain_timeout_s, left - DRAIN_MARGIN_S))
    notice = f"its node {address} is draining" + (f" (deadline in {left:.0f} s)" if left is not None else "")
    what = "replaced" if replace else "leaves without a replacement (it had one, or max_replicas)"
    reason = f"{replica_id} {what}: {notice}"
    event = ScaleEvent(now, size, size if replace else size - 1, reason, replicas=[replica_id])
    return event, budget, notice
