"""The proxy's section of the run config: where it listens, how it routes, its bounds on each call."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from rl_cluster.config.section import Section

# How long the trainer waits for the proxy's answer to a control call (rl_cluster.trainer.proxy_client):
# every bound the proxy puts on one control call stays below it, so the proxy's answer, not a client
# timeout, is what the run sees.
TRAINER_CONTROL_TIMEOUT_S = 600.0
# What an adapter load's deadline leaves the answer to reach the trainer.
CONTROL_ANSWER_MARGIN_S = 30.0


class ProxyConfig(Section):
    host: str | None = None
    """Address the proxy binds. None: loopback when the driver started a private local Ray, else the
    address of the proxy's node (the trainer and operators reach it from other nodes)."""
    port: int = Field(0, ge=0, le=65535)
    """Port the proxy binds; 0 picks a free one."""
    auth_token: SecretStr | None = None
    """Bearer token required on every proxy route but /health and /metrics: generation, /v1/models,
    /server_info and the control routes (load, unload, pause, resume, replicas). A training run generates one
    when unset, as does `serve` unless the proxy binds loopback; it is never logged or written to the
    bucket."""
    routing_policy: Literal["prefix", "round_robin", "least_loaded"] = "prefix"
    """How generation requests pick a replica: by prompt prefix (and adapter version) with the imbalance
    guard, or one of the two baselines the benchmarks compare it with."""
    block_size: int = Field(16, ge=1)
    """Prompt tokens (or characters, for text prompts) per routing hash block."""
    imbalance_threshold: int = Field(8, ge=0)
    """In-flight requests the prefix-preferred replica may exceed the least-loaded one by before spilling.
    At least trainer.num_generations: TRL sends a group's G samples at once, and they share a prompt."""
    table_capacity: int = Field(200_000, ge=1)
    """Prefix blocks the routing table remembers (LRU)."""
    pause_lease_s: float = Field(120.0, gt=0)
    """A pause without a resume within this time is ended by the proxy (a dead trainer must not freeze
    the cluster). A pause that waits for in-flight requests (`/pause?mode=wait`) waits at most this long
    for each replica; one that has not answered by then is down (out of routing until it catches up)."""
    load_retry_interval_s: float = Field(2.0, gt=0)
    """Seconds between retries of an adapter load a replica could not find yet (a lagging mount)."""
    load_deadline_s: float = Field(60.0, gt=0)
    """Seconds one replica may take over an adapter load (retries of "not found" included), an unload, a
    pause or a resume. One that gives no answer in time is treated as down: out of routing and left out
    of the sync, which goes on with the others; it catches up when it answers its health check again.
    A load still "not found" at the deadline fails (404)."""
    read_timeout_s: float | None = Field(None, gt=0)
    """Seconds a generation may go without a byte from its replica before the replica counts as hung
    (out of routing, the request retried elsewhere when nothing was sent yet). None: pause_lease_s plus
    one second per token of model.max_model_len, the longest completion the replicas can produce."""
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    """Largest request body accepted."""
    max_n: int = Field(128, ge=1)
    """Largest `n` (samples per request) a generation request may ask for; more is refused with 400."""
    max_sequences_per_request: int = Field(1024, ge=1)
    """Most sequences one generation request may ask for: its prompts times `n` (a chat request is one
    prompt); more is refused with 400. vLLM takes up to 1,024 prompts, so `max_n` alone lets one request
    queue 1,024 x `max_n` sequences. At least `max_n`."""
    health_interval_s: float = Field(5.0, gt=0)
    """Seconds between health checks of the replicas (GET /health). A replica that fails one leaves
    routing at once; when it answers again it reloads every live adapter version before it takes traffic."""
    health_timeout_s: float = Field(10.0, gt=0)
    """Seconds a replica's /health may take before the check counts as failed (generous: a busy CPU host
    answers slowly, and a false alarm costs a catch-up)."""
    unavailable_timeout_s: float = Field(300.0, gt=0, lt=TRAINER_CONTROL_TIMEOUT_S)
    """Seconds the proxy holds generation requests and adapter loads while no replica is active (all down
    or restarting) before it answers 503, which stops the run with that message. Below the trainer's
    600 s request timeout, so the proxy's answer, not a client timeout, is what the run reports."""
    load_timeout_s: float = Field(540.0, gt=0, le=TRAINER_CONTROL_TIMEOUT_S - CONTROL_ANSWER_MARGIN_S)
    """Seconds one `/v1/load_lora_adapter` may take at the proxy from end to end: waiting for an active
    replica, for the adapter lock (catch-ups hold it), the all-or-nothing load, its rollback and the
    retries while every replica is down. A broadcast starts only while one load and its rollback still
    fit (2 x load_deadline_s + health_timeout_s); past that the load is answered 504 with nothing
    loaded. At most the trainer's 600 s client timeout less 30 s, so the trainer gets the answer."""
    num_cpus: float = Field(0.0, ge=0)
    """CPUs the proxy actor reserves."""
    max_restarts: int = Field(3, ge=0)
    """Times Ray restarts the proxy actor after its process died. The new one binds the same address,
    and the run's pool controller hands it the generators, which tell it what they hold: it serves again
    once they caught up, with the versions they serve routable. Clients retry meanwhile (bounded)."""

    @property
    def broadcast_s(self) -> float:
        """The longest one load broadcast takes once started: each replica's load (load_deadline_s), the
        health probe that judges a failed one (health_timeout_s), the rollback (load_deadline_s)."""
        return 2 * self.load_deadline_s + self.health_timeout_s

    @model_validator(mode="after")
    def _a_load_fits_its_deadline(self) -> ProxyConfig:
        if self.load_timeout_s <= self.broadcast_s:
            raise ValueError(
                f"proxy.load_timeout_s={self.load_timeout_s:g} leaves no time for one load broadcast "
                f"(2 x load_deadline_s + health_timeout_s = {self.broadcast_s:g} s): raise it or lower those"
            )
        return self

    @model_validator(mode="after")
    def _n_fits_a_request(self) -> ProxyConfig:
        if self.max_n > self.max_sequences_per_request:
            raise ValueError(
                f"proxy.max_n={self.max_n} exceeds proxy.max_sequences_per_request="
                f"{self.max_sequences_per_request}: a one-prompt request with n = max_n would be refused"
            )
        return self
