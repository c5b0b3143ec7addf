"""One deadline for an operation made of several bounded steps.

Each step of, say, an adapter load (waiting for an active replica, for the adapter lock, the loads, a
rollback, a retry when every replica was down) has its own bound, but their sum can outlast the client
that asked for the operation, which then reports a failure for a load that went on and succeeded. A
Deadline is the operation's end, fixed when it starts; each step takes `within(its own bound)`, so the
whole is over by then whatever the steps do. The clock is a parameter so that tests need not wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Deadline:
    at: float
    """When the operation must be over, on `clock`."""
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    @classmethod
    def after(cls, seconds: float, clock: Callable[[], float] = time.monotonic) -> Deadline:
        return cls(clock() + seconds, clock)

    def left(self) -> float:
        """Seconds until the deadline, never negative."""
        return max(0.0, self.at - self.clock())

    @property
    def expired(self) -> bool:
        return self.left() <= 0.0

    def within(self, bound_s: float) -> float:
        """A step's own bound, cut to what is left of the whole."""
        return min(bound_s, self.left())
