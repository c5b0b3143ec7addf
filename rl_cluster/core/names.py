"""The Ray names of a run's actors, and the namespace its long-lived ones live in.

A driver's actors are anonymous to other drivers unless they are named in a fixed namespace. The pool
controller is found there by `rl-cluster scale` (another driver), and the generators by a restarted pool
controller (rl_cluster.pool), by a restarted proxy, and by the next driver of the same run, which stops
the generators a killed driver left (they are detached: they outlive the actor that started them).
"""

from __future__ import annotations

NAMESPACE = "rl_cluster"
_GENERATOR = "-generator-"


def pool_actor_name(run_name: str) -> str:
    return f"{run_name}-pool"


def generator_actor_name(run_name: str, replica_id: str) -> str:
    return f"{run_name}{_GENERATOR}{replica_id}"


def replica_of(run_name: str, actor_name: str) -> str | None:
    """The replica id of one of `run_name`'s generator actors, by its name; None for any other actor (a
    run named `a-generator-x` has no generators that another run's prefix would match: ids have no '-')."""
    prefix = f"{run_name}{_GENERATOR}"
    if not actor_name.startswith(prefix):
        return None
    replica = actor_name[len(prefix) :]
    return replica if replica and "-" not in replica else None


def replica_number(replica_id: str) -> int:
    """g7 -> 7: a restarted pool controller numbers new replicas past the ones it found."""
    return int(replica_id.lstrip("g"))
