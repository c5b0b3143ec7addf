"""The pool controller's look after its generators: a restarted actor is started again, one whose
restart budget is spent is stopped (so the policy can replace it). The cluster is an in-memory stand-in
with the two calls the controller makes; the real path runs in tests/integration/test_replica_restart.py."""

from __future__ import annotations

import asyncio

from rl_cluster.config import load_config
from rl_cluster.pool import PoolController


class Cluster:
    def __init__(self, restarted: list[str], spent: list[str], revive_fails: bool = False):
        self.config = load_config(None, ["run_name=pool-test", "generator.replicas=3"])
        self.generators = {"g0": object(), "g1": object(), "g2": object()}
        self.restarted, self.spent, self.revive_fails = restarted, spent, revive_fails
        self.revived: list[str] = []
        self.removed: list[str] = []

    async def generators_to_mend(self) -> dict[str, str]:
        return {**dict.fromkeys(self.restarted, "restarted"), **dict.fromkeys(self.spent, "spent")}

    async def revive(self, rid: str) -> None:
        if self.revive_fails:
            raise RuntimeError("vLLM did not start")
        self.revived.append(rid)

    async def remove_generator(self, rid: str) -> None:
        self.generators.pop(rid)
        self.removed.append(rid)


async def settle(pool: PoolController) -> None:
    await pool._mend()
    await asyncio.gather(*pool._tasks)


async def test_a_restarted_generator_is_started_again_and_a_spent_one_leaves():
    cluster = Cluster(restarted=["g0"], spent=["g2"])
    pool = PoolController(cluster)
    await settle(pool)
    assert cluster.revived == ["g0"]
    assert cluster.removed == ["g2"] and set(cluster.generators) == {"g0", "g1"}
    assert not pool._leaving  # done leaving: the policy now sees a pool of two


async def test_a_generator_that_fails_to_start_again_is_discarded():
    cluster = Cluster(restarted=["g1"], spent=[], revive_fails=True)
    pool = PoolController(cluster)
    await settle(pool)
    assert cluster.revived == [] and cluster.removed == ["g1"] and set(cluster.generators) == {"g0", "g2"}
