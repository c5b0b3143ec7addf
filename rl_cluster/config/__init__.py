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
from typing import Any

from pydantic import BaseModel, model_validator

from rl_cluster.config.generator import GeneratorConfig
from rl_cluster.config.proxy import TRAINER_CONTROL_TIMEOUT_S, ProxyConfig
from rl_cluster.config.section import (
    BucketConfig,
    CheckConfig,
    ClusterConfig,
    EvalConfig,
    ExperienceConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    Section,
    TaskConfig,
)
from rl_cluster.config.trainer import TrainerConfig

__all__ = [
    "BucketConfig", "CheckConfig", "ClusterConfig", "EvalConfig", "ExperienceConfig", "GeneratorConfig",
    "LoggingConfig", "LoraConfig", "ModelConfig", "ProxyConfig", "RunConfig", "Section", "TaskConfig",
    "TrainerConfig", "TRAINER_CONTROL_TIMEOUT_S", "config_reference", "load_config", "parse_override",
]  # fmt: skip

# What a trainer rank's peers allow rank 0 for one checkpoint's upload between two collectives (a rank-1
# LoRA checkpoint is a few MB; this covers the bucket's bounded retries against a slow store).
CHECKPOINT_UPLOAD_S = 300.0


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
