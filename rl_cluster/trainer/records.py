"""What crosses between the trainer's coordinator (the run's trainer actor) and the ranks Ray Train runs:
typed records, plain data (no torch, no Ray), so both sides and the unit tests import them cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankHello:
    """A rank has started: a first start, or one of a gang Ray Train restarted."""

    rank: int
    world_size: int
    address: str  # the node's IP, as Ray knows it
    node_id: str
    pid: int

    def placement(self) -> dict:
        return {"address": self.address, "node_id": self.node_id, "pid": self.pid}

    def line(self) -> str:
        """What the driver's log shows of it: `trainer rank R/N on ADDRESS (pid PID)`."""
        return f"trainer rank {self.rank}/{self.world_size} on {self.address} (pid {self.pid})"


@dataclass(frozen=True)
class RankStart:
    """The coordinator's answer once the run begins: which start of the gang this is (0: the first; more:
    Ray Train restarted it, and it resumes from the newest checkpoint), and the run's secrets, which reach
    the rank as a call's answer, never through a runtime_env or an argument Ray's dashboard shows."""

    attempt: int
    resume: bool  # the driver's --resume
    proxy_token: str | None = field(default=None, repr=False)
    replica_key: str | None = field(default=None, repr=False)
    environment: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Orders:
    """What a rank learns each time it asks (about once a second): whether to stop at the step's end, and
    the run lease's news for its write fence (rl_cluster.core.fence)."""

    stop: bool
    lease_left_s: float | None  # the lease is known held for this long from now; None: no news yet
    lost: str | None = None  # the driver lost the lease: why
