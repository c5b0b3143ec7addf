"""The run config: one pydantic tree, one TOML file per run, dotted command-line overrides.

Every field carries its documentation (docs/configuration.md is generated from it). Validators
reject combinations that cannot work; they never copy values between sections, so each value is set in
exactly one place. This module imports no Ray, vLLM, torch or HTTP library: `--help` and config checks
are instant.
"""

from __future__ import annotations

import datetime as _dt
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

# How long the trainer waits for the proxy's answer to a control call (rl_cluster.trainer.proxy_client):
# every bound the proxy puts on one control call stays below it, so the proxy's answer, not a client
# timeout, is what the run sees.
TRAINER_CONTROL_TIMEOUT_S = 600.0
# What an adapter load's deadline leaves the answer to reach the trainer.
CONTROL_ANSWER_MARGIN_S = 30.0
# What a trainer rank's peers allow rank 0 for one checkpoint's upload between two collectives (a rank-1
# LoRA checkpoint is a few MB; this covers the bucket's bounded retries against a slow store).
CHECKPOINT_UPLOAD_S = 300.0


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(Section):
    path: str = "tiny"
    """Base model: a Hugging Face hub id (resolved on every node through the Hugging Face cache, honouring
    HF_HOME, HF_HUB_OFFLINE and HF_TOKEN), a local directory every node has, or `tiny`: the locally made
    tiny Qwen2-architecture model (rl_cluster.tiny), built on first use, so a run needs no model hub
    (`tiny-math`: the same, warm-started on the MATH-format task rl_cluster.data.tiny_math)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub-id `path`; None is `main`. Pin a commit on a cluster,
    so every node serves the same weights."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision of the trainer's weights and the vLLM servers (both use the same one so logprobs agree)."""
    max_model_len: int = Field(256, gt=0)
    """Context length (prompt + completion tokens) the vLLM servers accept."""


class LoraConfig(Section):
    rank: int = Field(1, ge=1)
    """LoRA rank r. Rank 1 is enough for RL post-training and keeps each published adapter a few MB."""
    alpha: float = Field(2.0, gt=0)
    """LoRA alpha; the update is scaled by alpha / rank."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get an adapter: `all-linear` or a list of module names (never lm_head or embeddings)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """LoRA dropout."""


class TaskConfig(Section):
    prompts: Literal["tiny_arithmetic", "jsonl", "dataset"] = "tiny_arithmetic"
    """Where prompts come from: the built-in toy task (made locally, rl_cluster.tiny), a JSONL file of
    rows with a conversational `prompt` and extra columns that reach the reward functions, or `dataset`:
    a Hugging Face dataset (`task.dataset`), which `python -m rl_cluster.data prepare` writes into the
    bucket once and the run reads from there (rl_cluster.data), shuffled with trainer.seed."""
    jsonl_path: str | None = None
    """JSONL file of prompt rows, when `prompts = "jsonl"`."""
    num_prompts: int = Field(2000, gt=0)
    """How many toy-task prompts to generate (ignored for JSONL)."""
    rewards: list[str] = ["rl_cluster.core.rewards:arithmetic_reward"]
    """Reward functions as `module:function` import paths; each is `(completions, **columns) -> list[float]`."""
    dataset: str | None = None
    """For `prompts = "dataset"`: the dataset as `datasets.load_dataset` names it: a hub id
    (`DigitalLearningGmbH/MATH-lighteval`) or a file builder (`parquet`, `json`, `csv`) with `data_files`."""
    dataset_config: str | None = None
    """The dataset's configuration (subset) name, `load_dataset(name=...)`; None: its default."""
    dataset_revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub-id `dataset`; None is `main`."""
    data_files: dict[str, list[str]] = {}
    """Files per split for a file builder: `{ train = ["train.parquet"], test = ["test.parquet"] }`."""
    split: str = "train"
    """Split trained on."""
    eval_split: str | None = None
    """Held-out split that `prepare` also writes (as `eval`), never trained on; None: none."""
    columns: dict[str, str] = {}
    """Dataset column -> run column (`{ problem = "prompt", solution = "answer" }`); only mapped columns
    are kept. Empty: every column as it is. The run needs a `prompt` column; the others reach the reward
    functions as keyword arguments."""
    answer_from_solution: bool = False
    """The `answer` column holds a worked solution (MATH's `solution`): keep only its last `\\boxed{}`
    content. Rows without one are dropped with a count."""
    system_prompt: str | None = None
    """System message put before each text prompt; None: none (the chat template's default, if any)."""
    prompt_template: str = "{prompt}"
    """The user message made from a text prompt: `{prompt}` is replaced by it (plain replacement, so LaTeX
    braces need no escaping). Prompts that are already message lists are used as they are."""

    @model_validator(mode="after")
    def _dataset_fields(self) -> TaskConfig:
        if self.prompts == "dataset" and not self.dataset:
            raise ValueError('task.prompts = "dataset" needs task.dataset (a hub id, or "parquet"/"json")')
        if self.data_files and self.split not in self.data_files:
            raise ValueError(
                f"task.split={self.split!r} is not a key of task.data_files {sorted(self.data_files)}"
            )
        if self.eval_split is not None and self.eval_split == self.split:
            raise ValueError(
                f"task.eval_split={self.eval_split!r} is the training split: evaluation must be held out"
            )
        if self.eval_split is not None and self.data_files and self.eval_split not in self.data_files:
            raise ValueError(
                f"task.eval_split={self.eval_split!r} is not a key of task.data_files {sorted(self.data_files)}"
            )
        if self.answer_from_solution and self.columns and "answer" not in self.columns.values():
            raise ValueError('task.answer_from_solution needs a column mapped to "answer" in task.columns')
        if self.columns and "prompt" not in self.columns.values():
            raise ValueError('task.columns maps no column to "prompt"')
        if len(set(self.columns.values())) < len(self.columns):
            raise ValueError(f"task.columns maps two columns to the same name: {self.columns}")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("task.prompt_template must contain {prompt}")
        return self


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
    """GPUs each generator actor reserves."""
    pin_cpu_cores: bool = True
    """On CPU, bind replica i's engine to core i mod cores, so two engines do not share a core."""
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


class BucketConfig(Section):
    uri: str = "bucket"
    """Where adapters, configs and metrics go: a directory every node sees at the same path, or
    `s3://bucket/prefix`. Relative directories resolve against the working directory of the driver."""
    s3_endpoint_url: str | None = None
    """Endpoint of an S3-compatible store (for s3:// URIs); None uses AWS."""
    cache_dir: str = ".cache/bucket"
    """Generators' local mirror of the bucket in s3 mode: one per replica, with the bucket's layout, each
    version verified against its manifest before vLLM may load it."""
    keep_every: int = Field(0, ge=0)
    """Also keep every K-th version beyond the live window (0 keeps only the live window)."""


class CheckConfig(Section):
    samples: int = Field(4, ge=1)
    """Completions sampled from a replica after a sync to compare served and trained logprobs (in one
    request; more rounds of as many while they hold fewer than `min_tokens` tokens)."""
    min_tokens: int = Field(64, ge=1)
    """Completion tokens a replica's check is judged on, at least: rounds of `samples` completions are
    asked for until they hold this many (at most 8 rounds). A mean over a few tokens is at the mercy of
    one token that bf16 rounds badly (a check of 8 tokens once put a correct bf16 replica at 6.6 floors)."""
    every_syncs: int = Field(1, ge=1)
    """Run the served-vs-trained check after every N-th sync."""
    noise_multiple: float = Field(4.0, gt=1)
    """How many rounding floors the served logprobs may lie from the trained adapter's (mean absolute
    difference per token) and still count as served = trained. The floor is measured in each check, on its
    own tokens: the trainer's logprobs in `model.dtype` against the same computed one precision up. An
    alternative (the base model; the newest older version a check told apart) within twice this bound of
    the trained adapter cannot be told apart from it: that check is "too close to tell", never a failure."""


class EvalConfig(Section):
    every_steps: int = Field(0, ge=0)
    """Evaluate on the held-out split (`task.eval_split`, prepared as `eval`) every N optimizer steps, once
    before the first (step 0: the first published version, which is the base model), and after the last;
    0: never. Generated through the proxy under the newest version, so it measures what is served; the
    trainer waits for it. A multiple of trainer.sync_every, so each eval sees the policy of its step."""
    samples_k: int = Field(4, ge=1)
    """Completions sampled per problem for mean@k (the mean reward over k samples, averaged over problems);
    pass@1 is one greedy (temperature 0) completion per problem. At most proxy.max_n."""
    max_problems: int | None = Field(500, ge=1)
    """Eval problems used: a fixed sample of this many (the same ones at every eval, drawn with
    trainer.seed); None: the whole eval split."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the mean@k completions (top_p 1). Each problem's samples are seeded, the same
    at every eval, so two evals differ by the policy, not the draw."""
    concurrency: int = Field(32, ge=1)
    """Eval requests the trainer keeps in flight at once (one per problem: the greedy one, then n=k)."""


class LoggingConfig(Section):
    wandb: Literal["offline", "online", "off"] = "offline"
    """Weights & Biases logging of every step's metrics, the evals, the config and the summary. "offline"
    writes the run where `wandb_dir` says (`<bucket>/<run>/wandb/` for a directory bucket) for `wandb sync`
    later (no account, no network);
    "online" needs WANDB_API_KEY in the driver's or the trainer node's environment (never in a
    runtime_env, which the Ray dashboard shows)."""
    wandb_project: str = "rl_cluster"
    """W&B project the run is logged to."""
    wandb_entity: str | None = None
    """W&B entity (user or team); None: the API key's default entity."""
    wandb_dir: str | None = None
    """Directory wandb writes its run files into; None: `<bucket>/<run>/wandb/` for a directory bucket,
    else `.cache/wandb/<run>/` in the trainer's working directory."""


class ExperienceConfig(Section):
    enabled: bool = True
    """Append every group the trainer consumes, and every group dropped as stale, to
    `<bucket>/<run_name>/experience/` as Parquet shards (prompt and completion token ids, sampled logprobs,
    rewards, advantages, adapter version); read them with `python -m rl_cluster.experience RUN`."""
    shard_groups: int = Field(64, ge=1)
    """Groups per shard: a shard is written (off the training thread) once this many are buffered, and at
    the end of the run."""


class ClusterConfig(Section):
    address: str | None = None
    """Ray address to join. None joins a running cluster when there is one (RAY_ADDRESS, or one started
    with `ray start` on this machine), else starts a local one that declares the `trainer` and
    `generator` resources itself; "local" always starts a new local one."""


class RunConfig(Section):
    run_name: str
    """Name of the run: its directory in the bucket and its adapter-name prefix (`<run_name>-vN`). Unset:
    the TOML's stem and the UTC time it started (`cpu_demo-20261206-074221`), so no two runs share one."""
    model: ModelConfig = ModelConfig()
    lora: LoraConfig = LoraConfig()
    task: TaskConfig = TaskConfig()
    trainer: TrainerConfig = TrainerConfig()
    generator: GeneratorConfig = GeneratorConfig()
    proxy: ProxyConfig = ProxyConfig()
    bucket: BucketConfig = BucketConfig()
    check: CheckConfig = CheckConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    experience: ExperienceConfig = ExperienceConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        t, g = self.trainer, self.generator
        if t.completions_per_step % t.num_generations:
            raise ValueError(
                f"trainer.completions_per_step={t.completions_per_step} must be a multiple of "
                f"trainer.num_generations={t.num_generations} (whole GRPO groups per step)"
            )
        if g.max_loras < t.max_staleness + 2:
            raise ValueError(
                f"generator.max_loras={g.max_loras} cannot hold the live window: trainer.max_staleness="
                f"{t.max_staleness} needs at least {t.max_staleness + 2} adapter slots"
            )
        if self.lora.rank > g.max_lora_rank:
            raise ValueError(
                f"lora.rank={self.lora.rank} exceeds generator.max_lora_rank={g.max_lora_rank}; "
                "raise max_lora_rank (vLLM accepts 8, 16, 32, 64, ...)"
            )
        if self.proxy.imbalance_threshold < t.num_generations:
            raise ValueError(
                f"proxy.imbalance_threshold={self.proxy.imbalance_threshold} is below trainer.num_generations="
                f"{t.num_generations}: the G concurrent samples of one GRPO group would be split across replicas "
                "and lose their shared prefix cache"
            )
        if self.task.prompts == "jsonl" and not self.task.jsonl_path:
            raise ValueError('task.prompts = "jsonl" needs task.jsonl_path')
        if t.max_new_tokens >= self.model.max_model_len:
            raise ValueError(
                f"trainer.max_new_tokens={t.max_new_tokens} leaves no room for a prompt in model.max_model_len="
                f"{self.model.max_model_len} (prompt + completion); lower max_new_tokens or raise max_model_len"
            )
        if 0 < t.token_budget < self.model.max_model_len:
            raise ValueError(
                f"trainer.token_budget={t.token_budget} is below model.max_model_len={self.model.max_model_len}: "
                "a packed row could not hold the longest sample, and TRL drops such samples; raise token_budget "
                "to at least max_model_len (or 0 for no packing)"
            )
        # Rank 0's longest I/O between two collectives: one load answered at the client's bound, an upload,
        # then the next step's samples held while no replica serves.
        rank0_io = TRAINER_CONTROL_TIMEOUT_S + self.proxy.unavailable_timeout_s + CHECKPOINT_UPLOAD_S
        if t.collective_timeout_s < rank0_io:
            raise ValueError(
                f"trainer.collective_timeout_s={t.collective_timeout_s} is shorter than rank 0's I/O between "
                f"two collectives ({TRAINER_CONTROL_TIMEOUT_S:g} s for an adapter load + proxy.unavailable_timeout_s="
                f"{self.proxy.unavailable_timeout_s:g} + {CHECKPOINT_UPLOAD_S:g} s for an upload = {rank0_io:g} s): "
                "a healthy gang would time out; raise it"
            )
        if not all(c.isalnum() or c in "-_." for c in self.run_name):
            raise ValueError(f"run_name={self.run_name!r} may contain only letters, digits, '-', '_' and '.'")
        if not self.run_name.strip("."):  # `.` and `..` name a directory that is not the run's
            raise ValueError(
                f"run_name={self.run_name!r} needs a letter or digit; dots alone name other directories"
            )
        return self

    @model_validator(mode="after")
    def _eval_consistent(self) -> RunConfig:
        e = self.eval
        if not e.every_steps:
            return self
        if self.task.prompts != "dataset" or self.task.eval_split is None:
            raise ValueError(
                f'eval.every_steps={e.every_steps} needs a held-out split: task.prompts = "dataset" with '
                "task.eval_split set (or eval.every_steps = 0)"
            )
        if e.every_steps % self.trainer.sync_every:
            raise ValueError(
                f"eval.every_steps={e.every_steps} is not a multiple of trainer.sync_every={self.trainer.sync_every}: "
                "an eval between syncs would measure the version published before its step"
            )
        if e.samples_k > self.proxy.max_n:
            raise ValueError(f"eval.samples_k={e.samples_k} exceeds proxy.max_n={self.proxy.max_n}")
        return self


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.max_steps=20` -> (["trainer", "max_steps"], 20). Values are TOML; bare words are strings."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.field=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Read a run TOML, apply dotted overrides, validate. `run_name` defaults to the TOML's stem plus a
    UTC timestamp, so two runs never publish adapters under the same name."""
    data: dict[str, Any] = tomllib.loads(Path(path).read_text()) if path else {}
    for override in overrides:
        keys, value = parse_override(override)
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {override!r}: {key!r} is not a section")
        node[keys[-1]] = value
    if "run_name" not in data:
        stem = Path(path).stem if path else "run"
        data["run_name"] = f"{stem}-{_dt.datetime.now(_dt.UTC):%Y%m%d-%H%M%S}"
    return RunConfig.model_validate(data)


def config_reference(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, docstring) for every leaf field: docs/configuration.md."""
    rows = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += config_reference(annotation, f"{prefix}{name}.")
        else:
            # run_name is required of a RunConfig, not of a user: load_config names the run when nobody does.
            unset = "<TOML stem>-<UTC time>" if f"{prefix}{name}" == "run_name" else "required"
            default = unset if field.is_required() else repr(field.default)
            rows.append((f"{prefix}{name}", default, " ".join((field.description or "").split())))
    return rows
