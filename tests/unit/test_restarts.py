from rl_cluster.core.restarts import MAX_BACKOFF_S, RestartBudget


def test_restarts_are_bounded_and_back_off():
    budget = RestartBudget(max_restarts=3, backoff_s=2.0)
    assert [budget.next_delay(f"crash {i}") for i in range(4)] == [2.0, 4.0, 8.0, None]
    assert budget.used == 3 and budget.reasons == ["crash 0", "crash 1", "crash 2"]


def test_backoff_is_capped_and_zero_restarts_means_none():
    budget = RestartBudget(max_restarts=10, backoff_s=10.0)
    delays = [budget.next_delay("x") for _ in range(10)]
    assert max(delays) == MAX_BACKOFF_S and delays[:3] == [10.0, 20.0, 40.0]
    assert RestartBudget(max_restarts=0, backoff_s=1.0).next_delay("x") is None
