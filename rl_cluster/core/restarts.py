"""How often, and how soon, a crashed vLLM server is started again. Pure: no processes, no clocks.

A replica whose server dies is restarted in place (same node, same port, same key) at most
`max_restarts` times in a run, each time after a longer wait (`backoff_s` doubling, capped): a server
that dies at once again (a bad flag, an OOM) must not spin, and a transient crash must not cost the
replica for the rest of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_BACKOFF_S = 60.0


@dataclass
class RestartBudget:
    max_restarts: int
    backoff_s: float
    reasons: list[str] = field(default_factory=list)

    @property
    def used(self) -> int:
        return len(self.reasons)

    def next_delay(self, reason: str) -> float | None:
        """Seconds to wait before the next restart, or None when the budget is spent."""
        if self.used >= self.max_restarts:
            return None
        self.reasons.append(reason)
        return min(self.backoff_s * 2 ** (self.used - 1), MAX_BACKOFF_S)


@dataclass(frozen=True)
class GeneratorCondition:
    """What a generator actor tells the run's pool controller each round (GeneratorActor.condition)."""

    started: bool
    """start() began: False on a fresh actor, i.e. one Ray restarted after it died (the pool revives it)."""
    spent: bool
    """Its server's restart budget ran out: it stays down until the pool replaces it."""
    restarts: int
    """Its restarts so far: its server's in place, and its actor's own (each counts once)."""
    last_restart: str | None
    """Why the last restart was needed (None: none yet)."""
    slot: int | None
    """The replica index its server was started with (a successor pool controller keeps it)."""
