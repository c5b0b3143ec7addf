"""Bounded retries: the one policy every retry loop of the package runs under.

A retry that is not bounded turns an outage into a hang, so a policy always has a bound: a number of
attempts, a deadline, or both. Which errors are worth another try is the caller's knowledge, not the
policy's (a lagging mount's "not found" is, for the proxy; a bucket's "permission denied" never is), so
each call names them. When the bounds run out the call raises RetriesExhausted, carrying the last error,
how many attempts were made and over how long, and each caller turns that into its own error (a
BucketUnavailable, a ProxyControlError, ...). An error that is not retryable propagates at once, as it is.

The clock and the sleep are parameters so that tests run the schedule without waiting for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

Retryable = Callable[[Exception], bool]
OnRetry = Callable[[Exception, int, float], None]  # (error, attempts made so far, wait before the next)


class RetriesExhausted(Exception):
    """The policy's bounds ran out (or the caller asked it to stop) while the call still failed with a
    retryable error: `last`."""

    def __init__(self, last: Exception, attempts: int, elapsed_s: float):
        self.last = last
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        super().__init__(
            f"{attempts} attempts in {elapsed_s:.1f}s; last error: {type(last).__name__}: {last}"
        )


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` attempts, none started after `deadline_s` from the first (None: no such bound;
    one of the two is required), waiting `first_delay_s`, then `factor` times longer each time, at most
    `max_delay_s`, between them. `factor=1` waits the same every time.

    >>> [RetryPolicy(attempts=6, first_delay_s=0.5, max_delay_s=3).wait_before(n, 0.0) for n in range(1, 7)]
    [0.5, 1.0, 2.0, 3, 3, None]
    """

    attempts: int | None = None
    deadline_s: float | None = None
    first_delay_s: float = 1.0
    max_delay_s: float = 10.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts is None and self.deadline_s is None:
            raise ValueError("a retry policy needs attempts or deadline_s: unbounded retries hang")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts={self.attempts} must be >= 1")
        if self.first_delay_s < 0 or self.max_delay_s < 0 or self.factor < 1:
            raise ValueError(f"{self}: delays must be >= 0 and factor >= 1")

    def wait_before(self, attempt: int, elapsed_s: float) -> float | None:
        """The wait before attempt `attempt + 1`, when `attempt` attempts failed over `elapsed_s`; None when
        the bounds say stop. A wait that would end past the deadline is not started: the attempt after it
        could not begin in time."""
        if self.attempts is not None and attempt >= self.attempts:
            return None
        delay = min(self.first_delay_s * self.factor ** (attempt - 1), self.max_delay_s)
        if self.deadline_s is not None and elapsed_s + delay > self.deadline_s:
            return None
        return delay

    def call(
        self,
        fn: Callable[[], T],
        *,
        retryable: Retryable,
        on_retry: OnRetry | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> T:
        """fn(), tried again after each error `retryable` accepts, within the bounds; `on_retry` hears of
        each retry before its wait (to log it)."""
        started, attempt = clock(), 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as e:
                if not retryable(e):
                    raise
                delay = self.wait_before(attempt, clock() - started)
                if delay is None:
                    raise RetriesExhausted(e, attempt, clock() - started) from e
                if on_retry is not None:
                    on_retry(e, attempt, delay)
                sleep(delay)

    async def acall(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        retryable: Retryable,
        on_retry: OnRetry | None = None,
        stop: Callable[[], bool] | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> T:
        """`call` for a coroutine function. `stop`: the caller's own reason to give up early (another
        replica failed for real: no point waiting), checked before and after each wait; a `sleep` that
        returns as soon as that reason appears makes the give-up prompt."""
        started, attempt = clock(), 0
        while True:
            attempt += 1
            try:
                return await fn()
            except Exception as e:
                if not retryable(e):
                    raise
                delay = self.wait_before(attempt, clock() - started)
                if delay is None or (stop is not None and stop()):
                    raise RetriesExhausted(e, attempt, clock() - started) from e
                if on_retry is not None:
                    on_retry(e, attempt, delay)
                await sleep(delay)
                if stop is not None and stop():
                    raise RetriesExhausted(e, attempt, clock() - started) from e
