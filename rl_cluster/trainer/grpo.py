"""TRL's AsyncGRPOTrainer, with adapter syncs that go through the bucket and the proxy.

The adapter version lifecycle, from the trainer's side, is `BucketSyncTrainer.sync_adapter`:

1. save the adapter (TRL's own saver) into a local staging directory;
2. publish it as `<run>-vN` into the bucket: files first, manifest last (rl_cluster.bucket);
3. ask the proxy to load it; the proxy answers only once every replica verified and loaded it;
4. only then move the version counter, so new rollout groups ask for `<run>-vN`;
5. unload the version that fell out of the staleness window, and drop bucket files older than that
   (one sync later than the unload: vLLM re-reads evicted adapters from disk).

Generation is not paused: each version has its own name, so in-flight groups finish on the policy they
started with while the new one loads beside it. After each sync the trainer moves the admission limit
(rl_cluster.core.admission): how many samples the rollout loop may have started by the time the trainer
can no longer consume them within the staleness window (or, in lockstep mode, before the next sync).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

from trl.experimental.async_grpo.async_grpo_trainer import save_lora_adapter

from rl_cluster.bucket import Bucket
from rl_cluster.core.admission import AdmissionWindow
from rl_cluster.core.fence import WriteFence
from rl_cluster.core.manifest import AdapterMeta, adapter_dir_name, split_adapter_dir_name
from rl_cluster.trainer.batching import over_step_tokens, packed_steps, step_rows, train_rows
from rl_cluster.trainer.callbacks import any_rank
from rl_cluster.trainer.compat import (
    AdapterSyncTrainer,
    bound_score_queue,
    captured_forward,
    name_run_adapters,
    without_lookahead,
)
from rl_cluster.trainer.correction import OffPolicyCorrection
from rl_cluster.trainer.proxy_client import ProxyClient
from rl_cluster.trainer.rollout import TrainerPosition, pin_group_versions


class BucketSyncTrainer(AdapterSyncTrainer):
    """AsyncGRPOTrainer (its workarounds in compat's AdapterSyncTrainer) syncing through the bucket and the
    proxy, admitting groups by the staleness window, packing steps by `token_budget` and weighting its loss
    by `correction`."""

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
        admission: AdmissionWindow,
        first_version: int = 1,
        on_sample: Callable[[object, int, bool], None] | None = None,
        correction: OffPolicyCorrection,
        fence: WriteFence,
        **kwargs,
    ):
        super().__init__(*args, proxy_token=proxy.auth_token, **kwargs)
        if not self.syncs_adapters:
            raise RuntimeError(
                "rl_cluster publishes LoRA adapters only: the trainer needs a PEFT LoRA config and generators "
                "started with --enable-lora (check generator.max_loras and generator.max_lora_rank)"
            )
        name_run_adapters(self, run_name)
        self.admission = admission
        self._dropped_groups: set[int] = set()
        # Rank 0 alone has the rollout loop (TRL's child process) and its queue: it pulls every step's
        # samples, judges their staleness and hands each rank its row.
        self.position = None
        if self.accelerator.is_main_process:
            self.position = TrainerPosition(
                self.rollout_context, limit=admission.limit(pulled=0), proxy_url=proxy.address()
            )
            proxy.address.followers.append(self.position.follow_proxy)
            pin_group_versions(
                self, window=self.args.max_staleness, position=self.position, auth_token=proxy.auth_token
            )
            bound_score_queue(self, groups=max(1, admission.limit(pulled=0) // self.args.num_generations))
            self.rollout_queue = _CountingQueue(self.rollout_queue, self._on_pull)
        # A resumed run's checkpoint remembers the version current when it was taken, but versions were
        # published after it: names are never reused, so numbering continues after the highest one.
        self.first_version = first_version
        self.run_name = run_name
        self.bucket = bucket
        self.proxy = proxy
        self.base_model = base_model
        self.base_fingerprint = base_fingerprint
        self.keep_every = keep_every
        self.on_sync = on_sync
        self.on_sample = on_sample
        self.correction = correction
        self.fence = fence

    def _on_pull(self, sample) -> None:
        self.position.add(TrainerPosition.PULLED)
        # The rule TRL's RolloutQueueDataset applies right after this pull, against the same version.
        stale = self.model_version - sample.model_version > self.args.max_staleness
        if stale:
            self._dropped_groups.add(sample.group_id)
        if self.on_sample is not None:
            self.on_sample(sample, self.model_version, not stale)

    def get_train_dataloader(self):
        prepared = super().get_train_dataloader()
        if self.args.token_budget:
            # compat item 16: a step is completions_per_step samples, as admission counts them; the budget
            # bounds each packed row. Pulls no sample ahead either (item 11).
            return packed_steps(
                prepared,
                self.accelerator,
                self.args.per_device_train_batch_size * self.accelerator.num_processes,
                self.args.token_budget,
            )
        return without_lookahead(prepared, self.accelerator)

    def training_step(self, model, inputs, num_items_in_batch=None):
        rows = step_rows(inputs)
        if rows is None:
            return super().training_step(model, inputs, num_items_in_batch)
        return train_rows(super().training_step, model, rows, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        forward = captured_forward(model)  # compat item 21: the correction reads TRL's own forward
        loss = super().compute_loss(forward, inputs, return_outputs, num_items_in_batch)
        return over_step_tokens(self.correction.loss(self, forward.outputs, inputs, loss), inputs)

    def floating_point_ops(self, inputs) -> int:
        rows = step_rows(inputs)
        if rows is None:
            return super().floating_point_ops(inputs)
        flops = 0
        for batch in rows:  # not a generator expression: zero-argument super()
            flops += super().floating_point_ops(batch)
        return flops

    def group_counts(self) -> dict:
        """Groups by fate: `generated` (scored by the rollout loop), `trained`, `dropped_stale`, `failed`
        (a sample's generation raised); generated - trained - dropped_stale are still queued."""
        return {
            "generated": self.position[TrainerPosition.SCORED],
            "trained": len(self.trained_group_ids),
            "dropped_stale": len(self._dropped_groups),
            "failed": self.position[TrainerPosition.FAILED],
        }

    def sync_adapter(self, t0: float) -> tuple[float, float, float]:
        """Every rank saves (a collective: each gathers its shards), moves its version and calls `on_sync`
        (the check's forwards are collectives under FSDP2); rank 0 alone publishes, loads, unloads and
        applies retention. The other ranks go on to the next step, where its first collective holds them
        until rank 0 is done."""
        version = max(self.model_version + 1, self.first_version)
        name = adapter_dir_name(self.adapter_prefix, version)
        # Rank 0's fence decides for every rank (the save and the check are collectives): a refused
        # publication skips the whole sync, and the refusal stops training at this step's end.
        main = self.accelerator.is_main_process
        if any_rank(self.accelerator, main and not self.fence.admits(f"publish {name}")):
            now = time.time()
            return now, now, now
        model = self.accelerator.unwrap_model(self.model)
        if not main:
            with tempfile.TemporaryDirectory(prefix="rl_cluster-stage-") as stage:  # rank 0 writes the files
                save_lora_adapter(model, self.accelerator, self.peft_adapter, os.path.join(stage, name))
            self.model_version = version
            self.on_sync(version, name, {})
            now = time.time()
            return now, now, now
        peft_config = model.peft_config[self.peft_adapter]
        with tempfile.TemporaryDirectory(prefix="rl_cluster-stage-") as stage:
            save_lora_adapter(model, self.accelerator, self.peft_adapter, os.path.join(stage, name))
            t_saved = time.time()
            self.fence.check(f"publish {name}")
            uri = self.bucket.publish_adapter(
                self.run_name,
                self.adapter_prefix,
                version,
                os.path.join(stage, name),
                AdapterMeta(
                    base_model=self.base_model,
                    base_fingerprint=self.base_fingerprint,
                    rank=peft_config.r,
                    alpha=peft_config.lora_alpha,
                    target_modules=sorted(peft_config.target_modules),
                    trainer_step=self.state.global_step,
                ),
            )
        t_published = time.time()
        self.proxy.load_adapter(name, uri)
        t_routable = time.time()

        self.model_version = version
        self.rollout_worker.update_model_version(version)
        # After the version: a group admitted under the new limit is generated under the new version.
        self.position[TrainerPosition.LIMIT] = self.admission.limit(
            pulled=self.position[TrainerPosition.PULLED]
        )
        self._drop_stale(version)
        timings = {
            "save_s": t_saved - t0,
            "publish_s": t_published - t_saved,
            "handoff_s": t_routable - t_saved,
        }
        self.on_sync(version, name, timings)
        return t_saved, t_published, t_routable

    def _drop_stale(self, version: int) -> None:
        """Unload the versions that left the staleness window once `version` is current, and apply the
        bucket's retention to their files."""
        stale = version - (self.args.max_staleness + 1)
        # Every routable version of this run that left the window, not just `stale`: after a resume the
        # numbering jumps, and the proxy holds only what this job (or the trainer before a restart) loaded.
        for routable in self.proxy.routable_adapters():
            parsed = split_adapter_dir_name(routable)
            if parsed and parsed[0] == self.adapter_prefix and parsed[1] <= stale:
                self.proxy.unload_adapter(routable)
        if not self.fence.admits("delete the versions that left the staleness window"):
            return
        # Never delete what a replica still holds (a long request keeps an unloaded version loaded), and
        # keep files one sync past their unload: vLLM re-reads evicted adapters from disk.
        protected = set(range(max(stale - 1, 1), version + 1))
        for held in self.proxy.loaded_adapters():
            parsed = split_adapter_dir_name(held)
            if parsed and parsed[0] == self.adapter_prefix:
                protected.add(parsed[1])
        self.bucket.apply_retention(
            self.run_name,
            self.adapter_prefix,
            live_window=self.args.max_staleness + 2,
            keep_every=self.keep_every,
            protected=protected,
        )


class _CountingQueue:
    """The rollout buffer as the trainer's dataset sees it, telling `on_pull` about every sample pulled."""

    def __init__(self, queue, on_pull: Callable[[object], None]):
        self._queue = queue
        self._on_pull = on_pull

    def get(self, *args, **kwargs):
        sample = self._queue.get(*args, **kwargs)
        self._on_pull(sample)
        return sample

    def qsize(self) -> int:
        return self._queue.qsize()
