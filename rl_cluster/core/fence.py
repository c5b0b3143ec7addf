"""The writer's side of the run lease: the trainer writes into the run's bucket only while it knows the
lease is held.

The driver holds the run's lease (rl_cluster/bucket/lease.py), but the trainer is what writes: adapter
versions, checkpoints, retention's deletions, metrics. A driver that freezes (SIGSTOP, a paused VM, a
laptop asleep under a Ray client) cannot stop anything, and a `--resume` elsewhere takes the lease once
it expired. So the writer fences itself: after each renewal the driver tells it for how long the lease
is held from then on, and the writer allows writes until that time less `margin_s`, on its own monotonic
clock (no clock is compared across hosts). The margin covers the news's way from driver to trainer and a
successor whose clock runs ahead. A lease the driver lost is lost for good: no later news reopens it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rl_cluster.errors import LeaseLost


class WriteFence:
    """Writes allowed while the lease is known held. `first_news_s`: how long a check waits for the first
    news (a trainer just started, or restarted by Ray, hears from the driver within a renewal period)."""

    def __init__(
        self,
        margin_s: float,
        first_news_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[str], None] | None = None,
    ):
        self.margin_s, self.first_news_s, self.clock = margin_s, first_news_s, clock
        self.on_refused = on_refused  # told each write `admits` refused, with why
        self._deadline: float | None = None  # on `clock`: writes end here
        self._lost: str | None = None
        self._news = threading.Condition()

    def renewed(self, valid_for_s: float) -> None:
        """The driver renewed the lease: it is held for `valid_for_s` from when the renewal began."""
        with self._news:
            self._deadline = self.clock() + valid_for_s - self.margin_s
            self._news.notify_all()

    def lost(self, why: str) -> None:
        """The driver lost the lease (taken over, or not renewed in time): no write from here on."""
        with self._news:
            self._lost = why
            self._news.notify_all()

    def news(self) -> tuple[float | None, str | None]:
        """What this fence was told, to pass on to another writer's fence: (for how long from now the lease
        is known held, before any margin; None when no news came yet), and why it was lost (None: it was
        not)."""
        with self._news:
            left = None if self._deadline is None else self._deadline + self.margin_s - self.clock()
            return left, self._lost

    def refusal(self) -> str | None:
        """Why a write now would be refused, or None when it is allowed."""
        with self._news:
            if self._lost is None and self._deadline is None:
                self._news.wait_for(
                    lambda: self._lost is not None or self._deadline is not None, self.first_news_s
                )
            if self._lost is not None:
                return f"the driver lost the run's lease ({self._lost})"
            if self._deadline is None:
                return f"no news of the run's lease from the driver within {self.first_news_s:.0f} s"
            late = self.clock() - self._deadline
            if late >= 0:
                return (
                    f"the run's lease was last known held until {late:.0f} s ago (less a {self.margin_s:.0f} s "
                    "margin): the driver stopped renewing it (frozen, or cut off from the bucket), and another "
                    "driver may hold it now"
                )
            return None

    def admits(self, what: str) -> bool:
        """Whether a write of `what` may go ahead now. A refusal is handed to `on_refused` (the trainer ends
        at the end of the step under way, every rank together, and fails the run with it), not raised: a
        rank that raised mid-step would leave the others waiting in a collective."""
        why = self.refusal()
        if why is not None and self.on_refused is not None:
            self.on_refused(_refused(what, why))
        return why is None

    def check(self, what: str) -> None:
        """LeaseLost naming `what` when a write now would be refused."""
        why = self.refusal()
        if why is not None:
            raise LeaseLost(_refused(what, why))


def _refused(what: str, why: str) -> str:
    return f"the trainer refuses to {what}: {why}. The run that holds the lease writes this run"
