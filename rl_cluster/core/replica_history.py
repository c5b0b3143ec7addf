"""Where each generator replica ran over a run, and the faults it came through: summary.json's
`placement_history` and `faults`.

A replica has one *stint* per life of its generator actor: the node it ran on, from when, until when,
and why that ended (its node was lost, its actor process died, the pool removed it). A *fault* is a
spell out of service of a replica that had served: it opens when the pool controller first sees the
replica out of routing, its cause is filled in by whoever learns it (the actor was restarted on another
node, its vLLM server was restarted), and it closes, with the seconds it took, when the replica serves
again. A replica that never comes back keeps its fault open (`recovered_s` None).

Pure bookkeeping: the pool controller (rl_cluster.pool) feeds it what it sees, with its clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# What a replica's stint ended by, as summary.json says it.
NODE_LOST = "node lost"
ACTOR_DIED = "actor died"
REMOVED = "removed"
NODE_DRAINED = "node drained"  # Ray drained its node (a preemption notice): the pool replaced it in time
OUT_OF_ROUTING = "out of routing"  # a fault whose cause nobody named
# A cause learnt this long after an unnamed fault ended is another fault's (the pool looks every few seconds,
# a round waits up to a minute for each generator that does not answer).
CAUSE_LATE_S = 300.0


@dataclass
class Stint:
    address: str
    node_id: str
    began: float
    ended_at: float | None = None
    ended_by: str | None = None


@dataclass
class Fault:
    who: str  # a replica id, or an actor ("proxy")
    began: float  # when the pool first saw it out of routing (wall clock)
    what: str = OUT_OF_ROUTING  # replaced by the cause once it is known
    recovered_s: float | None = None  # out of routing until it served again; None: it never did

    def as_dict(self) -> dict:
        return {
            "time": round(self.began, 3),
            "what": self.what,
            "who": self.who,
            "recovered_s": None if self.recovered_s is None else round(self.recovered_s, 1),
        }


@dataclass
class ReplicaHistory:
    stints: dict[str, list[Stint]] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    _open: dict[str, Fault] = field(default_factory=dict)  # replica -> its fault still under way
    _served: set[str] = field(default_factory=set)  # replicas that were ever in routing

    def placed(self, replica: str, where: dict, now: float | None = None) -> None:
        """`replica` runs at `where` ({address, node_id}) from now on; a stint still open ends as replaced
        by this one (its actor was restarted)."""
        now = time.time() if now is None else now
        self.ended(replica, ACTOR_DIED, now)
        self.stints.setdefault(replica, []).append(Stint(where["address"], where["node_id"], now))

    def ended(self, replica: str, why: str, now: float | None = None) -> None:
        """The replica's current stint (if open) ended, by `why`."""
        stints = self.stints.get(replica)
        if stints and stints[-1].ended_at is None:
            stints[-1].ended_at, stints[-1].ended_by = (time.time() if now is None else now), why

    def current(self, replica: str) -> Stint | None:
        stints = self.stints.get(replica)
        return stints[-1] if stints and stints[-1].ended_at is None else None

    def observe(self, replica: str, serving: bool, why: str | None = None, now: float | None = None) -> None:
        """What the pool saw this round: `replica` in routing or not (`why` not: the proxy's reason, which
        names the fault until someone who knows more does). Out after having served opens a fault; in
        again closes it. (A replica leaving on purpose is not observed: the caller leaves it out.)"""
        now = time.time() if now is None else now
        fault = self._open.get(replica)
        if serving:
            self._served.add(replica)
            if fault is not None:
                fault.recovered_s = now - fault.began
                del self._open[replica]
            return
        if fault is None and replica in self._served:
            self._open[replica] = fault = Fault(replica, now)
            self.faults.append(fault)
        if fault is not None and why and fault.what == OUT_OF_ROUTING:
            fault.what = f"{OUT_OF_ROUTING} ({why})"

    def cause(self, replica: str, what: str, opens: bool = False, now: float | None = None) -> None:
        """Why `replica` is (or was just) out: names its open fault; else, unless `opens` (the caller knows
        it is out now: its actor died), its latest fault if still unnamed and over less than CAUSE_LATE_S
        ago (it came back before the cause was learnt). Else a fault opens now: the cause was learnt before
        the pool's round saw the replica out (two loops, seconds apart; once the cause was lost that way)."""
        now = time.time() if now is None else now
        fault = self._open.get(replica)
        if fault is None and not opens:
            mine = [f for f in self.faults if f.who == replica]
            last = mine[-1] if mine else None
            if (
                last is not None
                and last.what.startswith(OUT_OF_ROUTING)
                and last.recovered_s is not None
                and now - (last.began + last.recovered_s) <= CAUSE_LATE_S
            ):
                fault = last
        if fault is None and replica in self._served:
            self._open[replica] = fault = Fault(replica, now)
            self.faults.append(fault)
        if fault is not None:
            fault.what = what

    def record(self, who: str, what: str, began: float, recovered_s: float | None) -> Fault:
        """A fault its caller handles whole (the proxy's restart, a drained node's replica); the caller may
        set `recovered_s` on the returned record later."""
        self.faults.append(fault := Fault(who, began, what, recovered_s))
        return fault

    def forget(self, replica: str) -> None:
        """The replica left the pool: an open fault stays open (it never came back)."""
        self._open.pop(replica, None)
        self._served.discard(replica)

    def placement_history(self) -> dict[str, list[dict]]:
        """summary.json's `placement_history`: replica -> its stints, oldest first."""
        return {
            replica: [
                {
                    "address": s.address,
                    "node_id": s.node_id,
                    "from": round(s.began, 3),
                    "until": None if s.ended_at is None else round(s.ended_at, 3),
                    "ended_by": s.ended_by,
                }
                for s in stints
            ]
            for replica, stints in self.stints.items()
        }

    def fault_list(self) -> list[dict]:
        return [f.as_dict() for f in self.faults]
