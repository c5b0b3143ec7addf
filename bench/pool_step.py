"""The pool controller under a demand step: replicas over time, time to serve the new demand, overshoot.

The decisions are the real ones: rl_cluster.core.scaling.ScalingPolicy, sampled every TICK_S as the
PoolController samples the proxy, with rules for a cluster (grow above 8 in flight per replica held for
10 s, shrink after 60 s idle, 15 s cooldown). What it decides about is simulated, in simulated time (no
clock, no sleep). The load is closed, as a trainer's rollout workers are: CLIENTS each keep one request
outstanding, and their number steps from the base to 4x for five minutes, then to none. Every request goes
to the serving replica with the fewest in flight (the proxy's least-loaded choice: the prompts here share
nothing); a replica runs up to SLOTS at once, each for SERVICE_S, the rest wait in its queue. A replica
the policy adds serves after the node-start delay (a node, a vLLM start, a catch-up); one it removes takes
nothing new and leaves once its requests are done. One run per node-start delay.

"Served" is the first moment after the step (and before it ends) when the demand on the serving replicas
is at or below the threshold that grows the pool: the new demand has the replicas it needs. "Needed" is that many replicas
at the step's demand; overshoot is the most the pool had beyond it.
"""

from __future__ import annotations

import math

from rl_cluster.core.scaling import PoolSnapshot, ReplicaLoad, ScalingPolicy, ScalingRules

RULES = ScalingRules(min_replicas=2, max_replicas=32, up_in_flight=8, up_window_s=10, down_window_s=60,
                     cooldown_s=15)  # fmt: skip
TICK_S = 0.5  # the sampling interval, and the simulation's step
SLOTS = 16  # requests a replica runs at once
SERVICE_S = 2.0  # one request's time on a replica
CLIENTS = 12  # before the step: 6 in flight on each of the two replicas
STEP = 4
BEFORE_S, DURING_S, AFTER_S = 60.0, 300.0, 400.0


class _Replica:
    def __init__(self, rid: str, ready_at: float):
        self.rid, self.ready_at = rid, ready_at
        self.queue: list[float] = []  # remaining service seconds of its requests, oldest first
        self.requests = 0
        self.leaving = False

    def advance(self) -> int:
        """One tick: the first SLOTS requests run; returns how many finished."""
        running = [left - TICK_S for left in self.queue[:SLOTS]]
        self.queue = [left for left in running if left > 1e-9] + self.queue[SLOTS:]
        return sum(1 for left in running if left <= 1e-9)


def clients_at(t: float) -> int:
    return CLIENTS if t < BEFORE_S else CLIENTS * STEP if t < BEFORE_S + DURING_S else 0


def simulate(node_start_s: float, rules: ScalingRules = RULES) -> dict:
    """One run: the pool's size over time and what the step cost."""
    policy = ScalingPolicy(rules)
    replicas = [_Replica(f"g{i}", 0.0) for i in range(rules.min_replicas)]
    made, outstanding, t = rules.min_replicas, 0, 0.0
    needed = math.ceil(CLIENTS * STEP / rules.up_in_flight)
    timeline, served_at, peak, back_at = [], None, len(replicas), None
    while t < BEFORE_S + DURING_S + AFTER_S:
        outstanding -= sum(r.advance() for r in replicas)
        serving = [r for r in replicas if r.ready_at <= t and not r.leaving]
        while outstanding < clients_at(t) and serving:  # clients with nothing outstanding send again
            target = min(serving, key=lambda r: len(r.queue))
            target.queue.append(SERVICE_S)
            target.requests += 1
            outstanding += 1
        replicas = [r for r in replicas if not (r.leaving and not r.queue)]
        snap = PoolSnapshot(
            time=t,
            serving={r.rid: ReplicaLoad(len(r.queue), r.requests) for r in serving},
            starting=sum(1 for r in replicas if r.ready_at > t),
        )
        decision = policy.observe(snap)
        if decision is not None:
            replicas += [_Replica(f"g{made + i}", t + node_start_s) for i in range(decision.add)]
            made += decision.add
            for r in replicas:
                r.leaving = r.leaving or r.rid in decision.remove
        size = sum(1 for r in replicas if not r.leaving)
        peak = max(peak, size)
        if served_at is None and BEFORE_S <= t < BEFORE_S + DURING_S and snap.demand <= rules.up_in_flight:
            served_at = t - BEFORE_S
        if back_at is None and t >= BEFORE_S + DURING_S and size == rules.min_replicas:
            back_at = t - BEFORE_S - DURING_S
        timeline.append((t, size, len(serving)))
        t += TICK_S
    return {
        "node_start_s": node_start_s,
        "needed": needed,
        "peak": peak,
        "overshoot": peak - needed,
        "served_after_s": served_at,
        "back_to_min_after_s": back_at,
        "timeline": timeline[:: int(5 / TICK_S)],  # every 5 s: enough for the plot
    }


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    return {
        "rows": [simulate(delay) for delay in plan.pool_step_delays],
        "rules": {
            k: getattr(RULES, k)
            for k in (
                "min_replicas",
                "max_replicas",
                "up_in_flight",
                "up_window_s",
                "down_window_s",
                "cooldown_s",
            )
        },  # fmt: skip
        "load": {
            "clients": CLIENTS,
            "step": STEP,
            "before_s": BEFORE_S,
            "during_s": DURING_S,
            "after_s": AFTER_S,
            "slots": SLOTS,
            "service_s": SERVICE_S,
            "tick_s": TICK_S,
        },  # fmt: skip
    }
