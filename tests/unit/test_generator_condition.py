"""The record a generator actor answers the pool controller with each round (GeneratorCondition), read by
the driver's Cluster: a restarted actor is revived, a spent one replaced, a server restart recorded once."""

from __future__ import annotations

import pickle

from rl_cluster.cluster import Cluster
from rl_cluster.config import load_config
from rl_cluster.core.restarts import GeneratorCondition


class Call:
    def __init__(self, value):
        self.value = value

    def options(self, **_):
        return self

    def remote(self):
        async def answer():
            return self.value

        return answer()


class StandIn:
    """A generator actor's handle, as far as generators_to_mend uses it."""

    def __init__(self, condition: GeneratorCondition):
        self.condition = Call(pickle.loads(pickle.dumps(condition)))  # it crosses a process boundary


async def test_the_cluster_reads_each_generators_condition_record():
    cluster = Cluster(load_config(None, []), "/tmp", proxy=None, proxy_url="")
    cluster.generators = {
        "g0": StandIn(GeneratorCondition(False, False, 0, None, None)),
        "g1": StandIn(GeneratorCondition(True, True, 3, "vLLM server exited with code 1", 1)),
        "g2": StandIn(GeneratorCondition(True, False, 1, "vLLM server failed /health 3 times in a row", 2)),
    }
    for rid in cluster.generators:
        cluster.history.observe(rid, serving=True)  # each served before
    assert await cluster.generators_to_mend() == {"g0": "restarted", "g1": "spent"}
    assert cluster.restarts_seen == {"g1": 3, "g2": 1}
    faults = [(f.who, f.what) for f in cluster.history.faults]
    assert faults == [
        ("g1", "vLLM server restarted (vLLM server exited with code 1)"),
        ("g2", "vLLM server restarted (vLLM server failed /health 3 times in a row)"),
    ]
    assert await cluster.generators_to_mend() == {"g0": "restarted", "g1": "spent"}
    assert len(cluster.history.faults) == 2  # the same restarts: nothing new to record
