"""What crosses between the trainer's coordinator and its ranks (rl_cluster.trainer.records)."""

from __future__ import annotations

from rl_cluster.trainer.records import RankHello, RankStart


def test_a_rank_says_where_it_runs_in_the_line_an_operator_reads_and_in_the_summarys_placement():
    hello = RankHello(rank=0, world_size=1, address="10.231.7.3", node_id="ab12", pid=4242)
    assert hello.line() == "trainer rank 0/1 on 10.231.7.3 (pid 4242)"
    assert hello.placement() == {"address": "10.231.7.3", "node_id": "ab12", "pid": 4242}


def test_the_secrets_of_a_start_are_not_in_its_repr():
    """A record in a log or a traceback must not show the run's secrets."""
    start = RankStart(
        attempt=0, resume=False, proxy_token="tok-123", replica_key="key-456", environment={"W": "v-789"}
    )
    assert not any(secret in repr(start) for secret in ("tok-123", "key-456", "v-789"))
