"""The one retry policy (rl_cluster.core.retry): its bounds, its backoff, and what it never retries. The
clock is fake: each test runs its whole schedule in microseconds and reads the waits it would have made."""

from __future__ import annotations

import asyncio

import pytest

from rl_cluster.core.retry import RetriesExhausted, RetryPolicy


class FakeTime:
    """A clock that moves only when slept on (or when a call says it took time)."""

    def __init__(self):
        self.now = 100.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, delay: float) -> None:
        self.waits.append(delay)
        self.now += delay

    async def async_sleep(self, delay: float) -> None:
        self.sleep(delay)


class Flaky:
    """Fails with `error` the first `failures` times (taking `takes_s` of fake time each), then returns."""

    def __init__(self, time: FakeTime, failures: int, error: Exception | None = None, takes_s: float = 0.0):
        self.time, self.failures, self.takes_s = time, failures, takes_s
        self.error = error or ConnectionError("refused")
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        self.time.now += self.takes_s
        if self.calls <= self.failures:
            raise self.error
        return "ok"

    async def coroutine(self) -> str:
        return self()


def connection_errors(e: Exception) -> bool:
    return isinstance(e, ConnectionError)


def run(policy: RetryPolicy, fn: Flaky, time: FakeTime, **kwargs) -> str:
    return policy.call(fn, retryable=connection_errors, sleep=time.sleep, clock=time.clock, **kwargs)


def test_a_call_that_recovers_returns_its_value_after_backing_off():
    time = FakeTime()
    fn = Flaky(time, failures=3)
    assert run(RetryPolicy(attempts=5, first_delay_s=0.5, max_delay_s=8), fn, time) == "ok"
    assert fn.calls == 4 and time.waits == [0.5, 1.0, 2.0]


def test_attempts_bound_the_tries_and_the_last_error_is_kept():
    time = FakeTime()
    error = ConnectionError("refused")
    fn = Flaky(time, failures=10, error=error)
    with pytest.raises(RetriesExhausted) as caught:
        run(RetryPolicy(attempts=3, first_delay_s=1, max_delay_s=10), fn, time)
    assert fn.calls == 3 and time.waits == [1, 2]  # no wait after the last attempt
    assert caught.value.last is error and caught.value.__cause__ is error
    assert caught.value.attempts == 3 and caught.value.elapsed_s == 3
    assert "3 attempts" in str(caught.value) and "ConnectionError: refused" in str(caught.value)


def test_one_attempt_makes_no_retry_but_still_reports_exhaustion():
    time = FakeTime()
    fn = Flaky(time, failures=1)
    with pytest.raises(RetriesExhausted):
        run(RetryPolicy(attempts=1), fn, time)
    assert fn.calls == 1 and time.waits == []


def test_the_backoff_grows_by_its_factor_up_to_its_cap():
    time = FakeTime()
    fn = Flaky(time, failures=7)
    run(RetryPolicy(attempts=8, first_delay_s=1, max_delay_s=10), fn, time)
    assert time.waits == [1, 2, 4, 8, 10, 10, 10]


def test_factor_one_waits_the_same_every_time():
    policy = RetryPolicy(deadline_s=60, first_delay_s=2, max_delay_s=2, factor=1)
    assert [policy.wait_before(n, 0.0) for n in range(1, 5)] == [2, 2, 2, 2]


def test_the_deadline_stops_before_a_wait_that_would_end_past_it():
    time = FakeTime()
    fn = Flaky(time, failures=100)
    with pytest.raises(RetriesExhausted) as caught:
        run(RetryPolicy(deadline_s=30, first_delay_s=1, max_delay_s=10), fn, time)
    # 1+2+4+8 = 15 s waited; the next wait (10 s) would end at 25 s: started; the one after (10 s) would
    # end at 35 s, past 30: not started.
    assert time.waits == [1, 2, 4, 8, 10] and fn.calls == 6
    assert caught.value.elapsed_s == 25


def test_the_deadline_counts_the_time_the_attempts_take():
    time = FakeTime()
    fn = Flaky(time, failures=100, takes_s=9.5)  # each try hangs 9.5 s before it fails
    with pytest.raises(RetriesExhausted):
        run(RetryPolicy(deadline_s=20, first_delay_s=1, max_delay_s=1), fn, time)
    assert fn.calls == 2 and time.waits == [1]  # 9.5 + 1 + 9.5 = 20 s; one more wait would end at 21 s


def test_both_bounds_the_first_reached_wins():
    time = FakeTime()
    fn = Flaky(time, failures=100)
    with pytest.raises(RetriesExhausted):
        run(RetryPolicy(attempts=3, deadline_s=1000, first_delay_s=1), fn, time)
    assert fn.calls == 3


def test_an_error_the_caller_does_not_call_retryable_propagates_at_once():
    time = FakeTime()
    fn = Flaky(time, failures=5, error=PermissionError("denied"))
    with pytest.raises(PermissionError, match="denied"):
        run(RetryPolicy(attempts=5), fn, time)
    assert fn.calls == 1 and time.waits == []


def test_on_retry_hears_each_retry_before_its_wait_and_not_the_last_failure():
    time = FakeTime()
    heard: list[tuple[str, int, float]] = []
    fn = Flaky(time, failures=10)
    with pytest.raises(RetriesExhausted):
        run(RetryPolicy(attempts=3, first_delay_s=0.5), fn, time,
            on_retry=lambda e, attempt, delay: heard.append((str(e), attempt, delay)))  # fmt: skip
    assert heard == [("refused", 1, 0.5), ("refused", 2, 1.0)]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"attempts": 0}, {"attempts": 3, "first_delay_s": -1}, {"deadline_s": 5, "factor": 0.5}],
)
def test_an_unbounded_or_nonsensical_policy_is_refused(kwargs):
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


async def test_the_async_form_keeps_the_same_schedule():
    time = FakeTime()
    fn = Flaky(time, failures=2)
    result = await RetryPolicy(attempts=5, first_delay_s=0.5).acall(
        fn.coroutine, retryable=connection_errors, sleep=time.async_sleep, clock=time.clock
    )
    assert result == "ok" and time.waits == [0.5, 1.0]
    with pytest.raises(RetriesExhausted):
        await RetryPolicy(attempts=2).acall(
            Flaky(time, failures=9).coroutine, retryable=connection_errors, sleep=time.async_sleep,
            clock=time.clock,
        )  # fmt: skip


async def test_the_async_form_propagates_a_non_retryable_error_at_once():
    time = FakeTime()
    fn = Flaky(time, failures=3, error=ValueError("bad request"))
    with pytest.raises(ValueError):
        await RetryPolicy(attempts=5).acall(
            fn.coroutine, retryable=connection_errors, sleep=time.async_sleep, clock=time.clock
        )
    assert fn.calls == 1


async def test_stop_ends_the_retries_at_once_even_mid_wait():
    time = FakeTime()
    stopped = asyncio.Event()

    async def sleep_until_stopped(delay: float) -> None:
        time.sleep(delay)
        if len(time.waits) == 2:
            stopped.set()  # the caller's reason to give up appears during the second wait

    fn = Flaky(time, failures=100)
    with pytest.raises(RetriesExhausted) as caught:
        await RetryPolicy(deadline_s=60, first_delay_s=1, factor=1).acall(
            fn.coroutine, retryable=connection_errors, stop=stopped.is_set, sleep=sleep_until_stopped,
            clock=time.clock,
        )  # fmt: skip
    assert fn.calls == 2 and time.waits == [1, 1] and caught.value.attempts == 2

    fn = Flaky(time, failures=100)
    with pytest.raises(RetriesExhausted):  # already stopped: no wait at all
        await RetryPolicy(deadline_s=60).acall(
            fn.coroutine, retryable=connection_errors, stop=stopped.is_set, sleep=time.async_sleep
        )
    assert fn.calls == 1
