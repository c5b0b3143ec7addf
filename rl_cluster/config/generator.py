"""The generators' section of the run config: vLLM servers, their restarts, and the elastic pool."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rl_cluster.config.section import Section

TP_FLAGS = ("--tensor-parallel-size", "-tp")


class GeneratorConfig(Section):
    replicas: int = Field(2, ge=1)
    """vLLM generator actors (one server each) started with the run."""
    max_loras: int = Field(6, ge=1)
    """Adapter versions a vLLM server holds at once (`--max-loras`); at least max_staleness + 2."""
    max_lora_rank: int = Field(8, ge=1)
    """Largest adapter rank a server accepts (`--max-lora-rank`)."""
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """Which logprobs vLLM returns; processed ones match what the trainer recomputes."""
    enable_prefix_caching: bool = True
    """vLLM automatic prefix caching (the proxy's routing tries to make it hit)."""
    kv_cache_gb: int = Field(1, ge=1)
    """KV-cache size in GB for the CPU build (`VLLM_CPU_KVCACHE_SPACE`)."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Share of GPU memory vLLM may use (CUDA build only)."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs each generator actor reserves (with tensor parallelism: one per rank, `tensor_parallel_size`)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Devices one replica's vLLM server spans (`--tensor-parallel-size`): GPUs on the CUDA build, pinned
    cores on the CPU build. A replica asks its node for this many `generator` resources, so a node with
    `generator: K` holds K // tensor_parallel_size replicas."""
    pin_cpu_cores: bool = True
    """On CPU, bind each replica's engine to cores of its own node that no other replica there holds (one
    per tensor-parallel rank, claimed for the actor's life; rl_cluster.generator.cores); where none is
    free left, it shares cores and its log says so."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """vLLM's own log level in each replica's log (its server's `VLLM_LOGGING_LEVEL`, always set: a level
    in the driver's environment is not passed on, as TRL sets it to ERROR in every process that imports
    it: rl_cluster.generator.vllm_compat item 6)."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """Seconds a vLLM server may take to answer /health before the run fails."""
    max_restarts: int = Field(3, ge=0)
    """Times a replica's vLLM server is restarted in place after it died (or stopped answering /health)
    during a run, and separately the times Ray restarts its generator actor after that died; after that
    the replica stays out of routing and the others carry on."""
    restart_backoff_s: float = Field(2.0, gt=0)
    """Wait before the first restart of a replica; doubled for each further one (at most 60 s)."""
    extra_args: list[str] = []
    """Extra `vllm serve` flags, passed through unchanged."""
    min_replicas: int | None = Field(None, ge=1)
    """Fewest generators the pool controller keeps during a run; None: `replicas`. Below `max_replicas`
    the pool is elastic: it grows under demand and shrinks when replicas stay idle (rl_cluster.core.scaling)."""
    max_replicas: int | None = Field(None, ge=1)
    """Most generators the pool controller runs (on a cluster, the autoscaler adds `generator` nodes for
    them); None: `replicas`. `jobs/scale.py --replicas N` sets any N in [min_replicas, max_replicas]."""
    scale_up_in_flight: float = Field(16.0, gt=0)
    """Demand above which the pool grows: requests in flight (or queued at the proxy) per serving replica.
    It grows to as many replicas as carry the demand at this many each, at once."""
    scale_up_window_s: float = Field(30.0, gt=0)
    """Seconds demand must stay above `scale_up_in_flight`, in every sample, before replicas are added."""
    scale_down_window_s: float = Field(120.0, gt=0)
    """Seconds a replica must stay idle (nothing in flight, nothing routed to it) before it is removed."""
    scale_cooldown_s: float = Field(60.0, ge=0)
    """Seconds after an automatic change before the next one (a new replica needs time to take load)."""
    scale_interval_s: float = Field(2.0, gt=0)
    """Seconds between the pool controller's samples of the proxy's per-replica counts."""
    scale_up_timeout_s: float = Field(900.0, gt=0)
    """Seconds a new generator may take to get a node (the autoscaler may start one) and serve; after that
    it is given up, and the scale event records the failure."""
    drain_timeout_s: float = Field(300.0, gt=0)
    """Seconds a replica being removed waits for its in-flight requests before it is stopped anyway."""

    @property
    def replica_bounds(self) -> tuple[int, int]:
        """(min_replicas, max_replicas) with None read as `replicas`."""
        low = self.replicas if self.min_replicas is None else self.min_replicas
        return low, self.replicas if self.max_replicas is None else self.max_replicas

    @model_validator(mode="after")
    def _tensor_parallel_by_its_field(self) -> GeneratorConfig:
        # The flag passed through would start a server over devices its actor never reserved.
        if any(a in TP_FLAGS or a.startswith(tuple(f"{f}=" for f in TP_FLAGS)) for a in self.extra_args):
            raise ValueError(
                "generator.extra_args sets vLLM's tensor parallelism: set generator.tensor_parallel_size "
                "instead (each replica then reserves its devices)"
            )
        if self.tensor_parallel_size > 1 and self.num_gpus not in (0, self.tensor_parallel_size):
            raise ValueError(
                f"generator.num_gpus={self.num_gpus:g} with generator.tensor_parallel_size="
                f"{self.tensor_parallel_size}: a tensor-parallel replica reserves one GPU per rank, so set "
                f"generator.num_gpus={self.tensor_parallel_size} (or 0 on CPUs)"
            )
        return self

    @model_validator(mode="after")
    def _replicas_within_bounds(self) -> GeneratorConfig:
        low, high = self.replica_bounds
        if self.min_replicas is not None and self.max_replicas is not None and low > high:
            raise ValueError(f"generator.min_replicas={low} exceeds generator.max_replicas={high}")
        if not low <= self.replicas <= high:
            raise ValueError(
                f"generator.replicas={self.replicas} must lie within generator.min_replicas={low} .. "
                f"generator.max_replicas={high}"
            )
        return self
