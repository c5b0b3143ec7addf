"""The run config's base and its small sections: the model, LoRA, the task, the bucket, the served
check, evals, logging, the experience store and the cluster to join."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
