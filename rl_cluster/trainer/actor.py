"""TrainerActor: builds TRL's AsyncGRPOTrainer for a run config and trains against the proxy."""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import ray

from rl_cluster.bucket import Bucket
from rl_cluster.config import RunConfig
from rl_cluster.core.summary import progress_line, step_record
from rl_cluster.models import model_fingerprint, resolve_model
from rl_cluster.tiny import make_prompts
from rl_cluster.trainer.check import served_vs_trained_gap
from rl_cluster.trainer.proxy_client import ProxyClient


def import_function(path: str):
    """`package.module:function` -> the function (reward functions must be importable, not closures)."""
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"reward {path!r} must look like package.module:function")
    return getattr(importlib.import_module(module), name)


def load_prompts(config: RunConfig):
    from datasets import Dataset

    task = config.task
    if task.prompts == "jsonl":
        rows = []
        for number, line in enumerate(Path(task.jsonl_path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{task.jsonl_path} line {number} is not JSON ({e.msg}): {line[:80]!r}"
                ) from None
    else:
        rows = make_prompts(task.num_prompts, seed=config.trainer.seed)
    return Dataset.from_list(rows)


class Trainer:
    def __init__(self, config: RunConfig, proxy_url: str, proxy_token: str | None = None,
                 replica_key: str | None = None):  # fmt: skip
        """`proxy_token`: for the proxy's control routes; `replica_key`: for the served-vs-trained check,
        which samples from each replica directly."""
        self.config = config
        self.proxy_url = proxy_url
        configured = config.proxy.auth_token
        self.proxy = ProxyClient(
            proxy_url, proxy_token or (configured.get_secret_value() if configured else None)
        )
        self.replica_key = replica_key
        self.bucket = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url)
        self.history: list[dict] = []
        self.syncs: list[dict] = []
        self.last_sync: dict = {}
        self.checkpoints: list[str] = []
        self._base_fingerprint = ""
        self.trainer = None
        self._check_prompt_ids: list[int] = []
        self._train_start: float | None = None

    # -- reporting -------------------------------------------------------------------------------------
    def _on_step(self, step: int, logs: dict) -> None:
        record = step_record(step, logs, self.trainer.model_version, self.last_sync.get("handoff_s"))
        self.history.append(record)
        print(progress_line(record, self.config.trainer.max_steps), flush=True)
        if step % 10 == 0:
            self._write_metrics()

    def _write_metrics(self) -> None:
        lines = "".join(json.dumps(r) + "\n" for r in self.history)
        self.bucket.write_text(self.config.run_name, "metrics.jsonl", lines)

    def _on_sync(self, version: int, name: str, timings: dict) -> None:
        record = {"version": version, "adapter": name, **timings}
        check = self.config.check
        if version % check.every_syncs == 0 or version == 1:
            replicas = self.proxy.active_replica_urls()
            gaps = served_vs_trained_gap(
                self.trainer.accelerator.unwrap_model(self.trainer.model),
                replicas,
                name,
                self._check_prompt_ids,
                check.samples,
                self.config.trainer.max_new_tokens,
                api_key=self.replica_key,
            )
            record["served_vs_trained_gap"] = max(gaps.values())
            if not record["served_vs_trained_gap"] <= check.tolerance:
                print(
                    "\n" + "!" * 100 + f"\n!!! SERVED != TRAINED: {name} logprob gap {gaps} exceeds "
                    f"{check.tolerance}. The replicas do not serve the adapter the trainer trained; importance "
                    "ratios of this run are wrong.\n" + "!" * 100 + "\n",
                    flush=True,
                )
        self.syncs.append(record)
        self.last_sync = record

    def _publish_checkpoint(self, step: int, local_dir: str) -> None:
        uri = self.bucket.publish_checkpoint(
            self.config.run_name,
            step,
            local_dir,
            base_model=self.config.model.path,
            base_fingerprint=self._base_fingerprint,
        )
        shutil.rmtree(local_dir, ignore_errors=True)  # the bucket holds it now
        self.bucket.apply_checkpoint_retention(
            self.config.run_name, keep_last=self.config.trainer.keep_checkpoints
        )
        self.checkpoints.append(uri)
        print(f"checkpoint step {step} published to {uri}", flush=True)

    # -- training --------------------------------------------------------------------------------------
    def train(self) -> dict:
        from peft import LoraConfig
        from trl.experimental.async_grpo import AsyncGRPOConfig

        from rl_cluster.trainer.compat import (
            apply_trainer_workarounds,
            pipeline_limits,
            quiet_default_printer,
            training_precision_kwargs,
        )
        from rl_cluster.trainer.grpo import BucketSyncTrainer, CheckpointPublisher, StepReporter

        apply_trainer_workarounds()
        c = self.config
        t = c.trainer
        model_dir = resolve_model(c.model.path, c.model.revision)
        fingerprint = model_fingerprint(model_dir)
        self._base_fingerprint = fingerprint
        output_dir = tempfile.mkdtemp(prefix=f"rl_cluster-{c.run_name}-")
        args = AsyncGRPOConfig(
            output_dir=output_dir,
            vllm_server_base_url=self.proxy_url,
            learning_rate=t.learning_rate,
            lr_scheduler_type=t.lr_scheduler,
            adam_beta2=t.adam_beta2,
            num_generations=t.num_generations,
            per_device_train_batch_size=t.completions_per_step,
            max_completion_length=t.max_new_tokens,
            temperature=t.temperature,
            max_staleness=t.max_staleness,
            **pipeline_limits(t.completions_per_step, t.queue_steps, t.max_staleness),
            weight_sync_steps=t.sync_every,
            max_steps=t.max_steps,
            seed=t.seed,
            gradient_checkpointing=t.gradient_checkpointing,
            token_budget=t.token_budget,
            dtype=c.model.dtype,
            logging_steps=1,
            save_strategy="steps" if t.checkpoint_every else "no",
            save_steps=t.checkpoint_every or 500,
            report_to="none",
            disable_tqdm=True,
            **training_precision_kwargs(),
        )
        lora = LoraConfig(
            r=c.lora.rank,
            lora_alpha=c.lora.alpha,
            target_modules=c.lora.target_modules,
            lora_dropout=c.lora.dropout,
            task_type="CAUSAL_LM",
        )
        dataset = load_prompts(c)
        self.trainer = BucketSyncTrainer(
            model=str(model_dir),
            reward_funcs=[import_function(r) for r in c.task.rewards],
            args=args,
            train_dataset=dataset,
            peft_config=lora,
            callbacks=[StepReporter(self._on_step), CheckpointPublisher(self._publish_checkpoint)],
            run_name=c.run_name,
            bucket=self.bucket,
            proxy=self.proxy,
            base_model=c.model.path,
            base_fingerprint=fingerprint,
            keep_every=c.bucket.keep_every,
            on_sync=self._on_sync,
        )
        quiet_default_printer(self.trainer)
        tokenizer = self.trainer.processing_class
        self._check_prompt_ids = tokenizer.apply_chat_template(
            dataset[0]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        self._train_start = time.time()
        try:
            self.trainer.train()
        finally:
            self._write_metrics()
        return self.report()

    def report(self) -> dict:
        """What the run did so far: callable while train() runs (the actor has a second thread for it),
        so a stopped or failed run still gets its summary."""
        return {
            "history": list(self.history),
            "syncs": list(self.syncs),
            "checkpoints": list(self.checkpoints),
            "train_wall_s": time.time() - self._train_start if self._train_start else 0.0,
        }

    def placement(self) -> dict:
        from rl_cluster.cluster import node_placement

        return node_placement()


# Two threads: train() holds one for the whole run; report() and placement() answer on the other.
TrainerActor = ray.remote(max_concurrency=2)(Trainer)
