"""The trainer's section of the run config: optimisation, GRPO, staleness, checkpoints, ranks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rl_cluster.config.section import Section


class TrainerConfig(Section):
    learning_rate: float = Field(4e-5, gt=0)
    """Peak learning rate of AdamW."""
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule."""
    adam_beta2: float = Field(0.95, gt=0, lt=1)
    """AdamW beta2."""
    num_generations: int = Field(8, ge=2)
    """Completions sampled per prompt (the GRPO group size)."""
    completions_per_step: int = Field(128, gt=0)
    """Completions consumed by one optimizer step; a multiple of num_generations."""
    max_new_tokens: int = Field(128, gt=0)
    """Longest completion the generators produce."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of rollouts."""
    max_staleness: int = Field(4, ge=0)
    """Largest policy-version lag a rollout may have when trained on; older ones are dropped."""
    correction: Literal["none", "tis", "icepop"] = "icepop"
    """Off-policy correction of the loss for what rounding (vLLM's kernels against the trainer's: ~1e-2 per
    token in bf16) and staleness leave between the policy that sampled a token and the one trained.
    `none`: TRL's loss (its ratio to vLLM's logprobs, clipped). `tis`: truncated importance sampling,
    each token's gradient weighted by min(pi_train / pi_vllm, correction_cap), without the clip.
    `icepop`: TRL's loss, with tokens whose pi_train / pi_vllm leaves correction_band masked out. Under
    `tis` and `icepop`, tokens whose vLLM logprob is -inf or NaN are masked. The default, `icepop`, had the
    best reward of the three in bf16 at max_staleness 4 (BENCHMARKS.md section 11, within the seeds'
    spread) and leaves TRL's loss as it is on every token inside the band (99.9 % there)."""
    correction_cap: float = 2.0
    """Largest importance weight under `tis`; above 1 (a cap at 1 truncates on-policy tokens too)."""
    correction_band: tuple[float, float] = (0.5, 5.0)
    """The (low, high) band of pi_train / pi_vllm a token must lie in under `icepop`, around 1."""
    mode: Literal["async", "sync"] = "async"
    """`async`: generation runs ahead of training, and a group starts only when the trainer will consume
    it within max_staleness versions (admission follows the trainer, so little is dropped). `sync`: the
    lockstep loop of synchronous trainers, the baseline the benchmarks compare with: the samples of the
    next sync_every steps are generated only after the sync before them, so none is ever stale."""
    sync_every: int = Field(4, ge=1)
    """Optimizer steps between adapter publications (weight syncs)."""
    max_steps: int = Field(500, gt=0)
    """Optimizer steps of the run."""
    checkpoint_every: int = Field(0, ge=0)
    """Optimizer steps between checkpoints (adapter, optimizer, scheduler and trainer state) published to
    `<bucket>/<run_name>/checkpoints/step-N/` with a manifest; 0 publishes none."""
    keep_checkpoints: int = Field(2, ge=1)
    """Newest checkpoints kept in the bucket; older ones are deleted (manifest first)."""
    max_restarts: int = Field(1, ge=0)
    """Times Ray Train restarts the trainer's ranks, as one gang, after one died (its process killed, its
    node lost) while the run goes on (Ray Train's FailureConfig.max_failures); the restarted gang resumes
    from the newest verified checkpoint in the bucket."""
    unresponsive_timeout_s: float = Field(300.0, ge=10)
    """A rank whose process does not answer Ray Train's health check for this long (SIGSTOPped, a paused
    VM, its node cut off) counts as dead: the gang restarts, as after a killed rank. The health check is
    answered beside training, so a rank busy in a long step, an upload or an adapter load still answers."""
    collective_timeout_s: int = Field(1800, ge=1)
    """Seconds a trainer rank waits in one collective (the step's gradients, rank 0's hand-out of the next
    step's samples, the stop) before it fails, and the gang restarts: what ends a gang whose rank 0 hangs
    while its process still answers Ray Train's health check (a hung mount, a stuck upload). Rank 0's I/O
    between two collectives (an adapter load, a checkpoint upload, the next step's samples while no
    replica serves) must fit: at least the trainer's 600 s load timeout + proxy.unavailable_timeout_s +
    300 s for an upload. An eval or a served-vs-trained check longer than this ends the attempt too."""
    seed: int = 0
    """Seed for LoRA init, data order and sampling."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (saves memory on long contexts)."""
    token_budget: int = 0
    """Most tokens one forward of the trainer holds (peak memory): a step's completions_per_step samples
    are packed into rows of at most token_budget unique tokens, one forward and backward each, gradients
    accumulated into the step's one update; 0 trains the step's samples in one forward. At least
    model.max_model_len."""
    num_workers: int = Field(1, ge=1)
    """Data-parallel ranks of the trainer (DDP: gloo on CPU, NCCL on GPUs), placed on one node (or
    several: span_nodes) with the `trainer` resource (each rank takes one) and restarted together by Ray Train. Each trains
    completions_per_step / num_workers samples of every step; rank 0 alone publishes, loads, checkpoints,
    evaluates and reports."""
    span_nodes: bool = False
    """Let the ranks span trainer nodes when one node cannot hold them all (Ray's PACK: as few nodes as
    hold them, e.g. 2 nodes x 4 GPUs for 8 ranks); gloo and NCCL then cross the network every step. Off,
    every rank is on one node (STRICT_PACK), and a run whose ranks no node can hold is refused."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """How the ranks hold the model. `ddp`: each rank holds all of it, gradients are all-reduced: the
    fastest while the model, its activations and (with LoRA, small) optimizer state fit one device.
    `fsdp2`: torch's fully_shard, each rank holds 1/num_workers of every weight and gathers a decoder
    layer's weights as its forward and backward need them: for a model that does not fit one device,
    at the cost of those gathers. Checkpoints are full-state (flat) either way."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs each trainer rank reserves (Ray sets OMP_NUM_THREADS from it); the trainer actor that
    coordinates the ranks, on the driver's node, reserves none."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs each trainer rank reserves."""

    @model_validator(mode="after")
    def _ranks(self) -> TrainerConfig:
        if self.num_workers == 1:
            if self.strategy == "fsdp2":
                raise ValueError(
                    'trainer.strategy = "fsdp2" shards the model over trainer.num_workers ranks, and there is '
                    'one: set num_workers = 2 or more, or strategy = "ddp"'
                )
            if self.span_nodes:
                raise ValueError(
                    "trainer.span_nodes lets the trainer's ranks span nodes, and there is one rank: set "
                    "trainer.num_workers = 2 or more, or span_nodes = false"
                )
            return self
        if self.completions_per_step % self.num_workers:
            raise ValueError(
                f"trainer.completions_per_step={self.completions_per_step} does not split evenly into "
                f"trainer.num_workers={self.num_workers} ranks: make it a multiple of {self.num_workers}"
            )
        if self.mode == "sync":
            raise ValueError(
                f"trainer.mode = 'sync' runs one trainer rank: use mode = 'async' with num_workers={self.num_workers}"
            )
        return self

    @model_validator(mode="after")
    def _correction_bounds(self) -> TrainerConfig:
        if not self.correction_cap > 1:
            raise ValueError(
                f"trainer.correction_cap={self.correction_cap} must be above 1: a cap at or under 1 truncates "
                "the weight of tokens that were sampled on-policy too"
            )
        low, high = self.correction_band
        if not 0 < low < 1 < high:
            raise ValueError(
                f"trainer.correction_band={list(self.correction_band)} must hold 1 strictly inside, with a "
                "positive low end (e.g. [0.5, 5.0]): a band without 1 masks every on-policy token"
            )
        return self
