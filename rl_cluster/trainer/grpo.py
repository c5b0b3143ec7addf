"""TRL's AsyncGRPOTrainer, with adapter syncs that go through the bucket and the proxy.

The adapter version lifecycle, from the trainer's side, is `BucketSyncTrainer._sync_weight_lora`:

1. save the adapter (TRL's own saver) into a local staging directory;
2. publish it as `<run>-vN` into the bucket: files first, manifest last (rl_cluster.bucket);
3. ask the proxy to load it; the proxy answers only once every replica verified and loaded it;
4. only then move the version counter, so new rollout groups ask for `<run>-vN`;
5. unload the version that fell out of the staleness window, and drop bucket files older than that
   (one sync later than the unload: vLLM re-reads evicted adapters from disk).

Generation is not paused: each version has its own name, so in-flight groups finish on the policy they
started with while the new one loads beside it.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

from transformers import TrainerCallback
from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, save_lora_adapter

from rl_cluster.bucket import Bucket
from rl_cluster.core.manifest import adapter_dir_name, split_adapter_dir_name
from rl_cluster.trainer.compat import bound_score_queue, is_step_log, name_run_adapters, pin_group_versions
from rl_cluster.trainer.proxy_client import ProxyClient


class BucketSyncTrainer(AsyncGRPOTrainer):
    def __init__(
        self,
        *args,
        run_name: str,
        bucket: Bucket,
        proxy: ProxyClient,
        base_model: str,
        base_fingerprint: str,
        keep_every: int,
        on_sync: Callable[[int, str, dict], None],
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if not self._lora_sync:
            raise RuntimeError(
                "rl_cluster publishes LoRA adapters only: the trainer needs a PEFT LoRA config and generators "
                "started with --enable-lora (check generator.max_loras and generator.max_lora_rank)"
            )
        name_run_adapters(self, run_name)
        pin_group_versions(self, window=self.args.max_staleness)
        bound_score_queue(
            self, groups=max(1, self.args.per_device_train_batch_size // self.args.num_generations)
        )
        self.run_name = run_name
        self.bucket = bucket
        self.proxy = proxy
        self.base_model = base_model
        self.base_fingerprint = base_fingerprint
        self.keep_every = keep_every
        self.on_sync = on_sync

    def _sync_weight_lora(self, t0: float) -> tuple[float, float, float]:
        version = self.model_version + 1
        name = adapter_dir_name(self._lora_name, version)
        model = self.accelerator.unwrap_model(self.model)
        peft_config = model.peft_config[self._adapter_name]
        with tempfile.TemporaryDirectory(prefix="rl_cluster-stage-") as stage:
            save_lora_adapter(model, self.accelerator, self._adapter_name, os.path.join(stage, name))
            t_saved = time.time()
            uri = self.bucket.publish_adapter(
                self.run_name,
                self._lora_name,
                version,
                os.path.join(stage, name),
                base_model=self.base_model,
                base_fingerprint=self.base_fingerprint,
                rank=peft_config.r,
                alpha=peft_config.lora_alpha,
                target_modules=sorted(peft_config.target_modules),
                trainer_step=self.state.global_step,
            )
        t_published = time.time()
        self.proxy.load_adapter(name, uri)
        t_routable = time.time()

        self.model_version = version
        self.rollout_worker.update_model_version(version)
        stale = version - (self.args.max_staleness + 1)
        if stale > 0:
            self.proxy.unload_adapter(adapter_dir_name(self._lora_name, stale))
        # Never delete what a replica still holds (a long request keeps an unloaded version loaded), and
        # keep files one sync past their unload: vLLM re-reads evicted adapters from disk.
        protected = set(range(max(stale - 1, 1), version + 1))
        for held in self.proxy.loaded_adapters():
            parsed = split_adapter_dir_name(held)
            if parsed and parsed[0] == self._lora_name:
                protected.add(parsed[1])
        self.bucket.apply_retention(
            self.run_name,
            self._lora_name,
            live_window=self.args.max_staleness + 2,
            keep_every=self.keep_every,
            protected=protected,
        )
        timings = {
            "save_s": t_saved - t0,
            "publish_s": t_published - t_saved,
            "handoff_s": t_routable - t_saved,
        }
        self.on_sync(version, name, timings)
        return t_saved, t_published, t_routable


class StepReporter(TrainerCallback):
    """Hands each step's logged metrics to a function (TRL's progress bar does not reach Ray job logs)."""

    def __init__(self, report: Callable[[int, dict], None]):
        self.report = report

    def on_log(self, args, state, control, logs=None, **kwargs):
        if is_step_log(logs):
            self.report(state.global_step, dict(logs))


class CheckpointPublisher(TrainerCallback):
    """Moves each checkpoint the trainer saves locally into the bucket (files, then manifest)."""

    def __init__(self, publish: Callable[[int, str], None]):
        self.publish = publish

    def on_save(self, args, state, control, **kwargs):
        local = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(local):
            self.publish(state.global_step, local)
