"""TrainerActor: builds TRL's AsyncGRPOTrainer for a run config and trains against the proxy."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ray

from rl_cluster.bucket import LEASE_TTL_S, Bucket
from rl_cluster.config import RunConfig
from rl_cluster.core.evaluation import eval_line, eval_record, with_evals
from rl_cluster.core.fence import WriteFence
from rl_cluster.core.manifest import adapter_dir_name
from rl_cluster.core.summary import progress_line, step_record
from rl_cluster.core.telemetry import GROUP_FATES, TRAINER_METRICS, finite, step_values
from rl_cluster.models import model_fingerprint, resolve_model
from rl_cluster.nodes import node_placement
from rl_cluster.telemetry import RayMetricSet
from rl_cluster.trainer.build import build_trainer, evaluator, experience_writer, import_in_background
from rl_cluster.trainer.check import ServedCheck
from rl_cluster.trainer.checkpoints import (
    KeptCheckpoints,
    newest_checkpoint,
    read_state,
    restart_fault,
    resume_line,
)
from rl_cluster.trainer.once import Once
from rl_cluster.trainer.proxy_client import ProxyClient
from rl_cluster.trainer.task import load_prompts
from rl_cluster.trainer.wandb_log import start_wandb


class Trainer:
    def __init__(self, config: RunConfig, proxy_url: str, proxy_token: str | None = None,
                 replica_key: str | None = None, environment: dict[str, str] | None = None):  # fmt: skip
        """`proxy_token`: for the proxy; `replica_key`: for the served-vs-trained check, which samples
        from each replica directly; `environment`: the driver's secrets (HF_TOKEN, WANDB_API_KEY)."""
        os.environ.update(environment or {})
        self.config = config
        self.proxy_url = proxy_url
        configured = config.proxy.auth_token
        self.proxy = ProxyClient(
            proxy_url, proxy_token or (configured.get_secret_value() if configured else None)
        )
        self.replica_key = replica_key
        self.bucket = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url)
        self.history: list[dict] = []
        self.evals: list[dict] = []  # held-out evals (rl_cluster.core.evaluation records)
        self._evaluator = None
        self.syncs: list[dict] = []
        self.last_sync: dict = {}
        self.fence = WriteFence(margin_s=LEASE_TTL_S / 4, first_news_s=LEASE_TTL_S / 2)  # before each write
        self.checkpoints = KeptCheckpoints(self.bucket, config, self.fence)
        self.faults: list[dict] = []  # Ray's restarts of it; this life's closes at its first step trained
        self._restarted: dict | None = None
        self._base_fingerprint = ""
        self.trainer = None
        self._check_prompt_ids: list[int] = []
        self._train_start: float | None = None
        self.resumed_from_step: int | None = None
        self._groups_before: dict = {}  # groups of the run before the checkpoint it resumed from
        self._served_check = ServedCheck(config)
        self.metrics = RayMetricSet(TRAINER_METRICS, config.run_name)
        self._wandb = None
        self._experience = None  # rl_cluster.experience.ExperienceWriter, made with the trainer
        self._once = Once()  # run(): one train() per life of this actor, whoever asks how often
        self._imported = import_in_background()  # while the generators start: train() waits for it

    # -- reporting -------------------------------------------------------------------------------------
    def _on_step(self, step: int, logs: dict) -> None:
        if self.history and step <= self.history[-1]["step"]:
            return  # a trainer restored at its last step logs that step once more: the record has it
        record = step_record(step, logs, self.trainer.model_version, self.last_sync.get("handoff_s"))
        self.history.append(record)
        if self._restarted is not None:
            self._restarted["recovered_s"] = round(time.time() - self._restarted["time"], 1)
            self._restarted = None
        print(progress_line(record, self.config.trainer.max_steps), flush=True)
        gauges, observed = step_values(record)
        for name, value in gauges.items():
            self.metrics.set(name, value)
        for name, value in observed.items():
            self.metrics.observe(name, value)
        self._wandb.log_step(step, record)
        counts = self._group_counts()
        for fate in GROUP_FATES:
            self.metrics.set("rl_trainer_groups", counts[fate], fate=fate)
        if step % 10 == 0:
            self._write_metrics()

    def _write_metrics(self) -> None:
        if (refused := self.fence.refusal()) is not None:
            print(f"metrics.jsonl not written: {refused}", flush=True)
            return
        lines = "".join(json.dumps(r) + "\n" for r in with_evals(self.history, self.evals))
        self.bucket.write_text(self.config.run_name, "metrics.jsonl", lines)

    def _on_sync(self, version: int, name: str, timings: dict) -> None:
        record = {"version": version, "adapter": name, **timings}
        if self._served_check.due(version):
            record.update(
                self._served_check.run(
                    self.trainer.accelerator.unwrap_model(self.trainer.model), self.proxy.active_replica_urls(),
                    name, self._check_prompt_ids, api_key=self.replica_key,
                )
            )  # fmt: skip
        self.syncs.append(record)
        self.last_sync = record
        self.metrics.observe("rl_trainer_handoff_seconds", timings["handoff_s"])
        if "check" in record:
            self.metrics.set("rl_trainer_served_vs_trained_gap", record["served_vs_trained_gap"])
            self.metrics.set(
                "rl_trainer_served_vs_trained_floor", max(r["floor"] for r in record["check"]["replicas"])
            )

    def _on_sample(self, sample, trainer_version: int, trained: bool) -> None:
        """Every sample the trainer pulls, on the training thread: keep it cheap."""
        self.metrics.observe("rl_trainer_staleness", trainer_version - sample.model_version)
        if self._experience is not None:
            self._experience.add(sample, trainer_version=trainer_version, trained=trained)

    def _on_eval(self, step: int) -> None:
        """Eval of the newest version on the held-out split (rl_cluster.trainer.evaluation); once per step
        (a resumed run's train-begin eval repeats none it already has)."""
        if any(e["step"] == step for e in self.evals):
            return
        version = self.trainer.model_version
        adapter = adapter_dir_name(self.config.run_name, version)
        start = time.time()
        scores = self._evaluator.run(adapter)
        record = eval_record(step, adapter, version, scores, time.time() - start)
        self.evals.append(record)
        print(eval_line(record), flush=True)
        for score in ("pass@1", "mean@k"):
            if (value := finite(record.get(score))) is not None:
                self.metrics.set("rl_trainer_eval", value, score=score)
        self._wandb.log_eval(record)
        self._write_metrics()

    def _publish_checkpoint(self, step: int, local_dir: str) -> None:
        self._write_metrics()
        state = {
            "history": self.history,
            "syncs": self.syncs,
            "groups": self._group_counts(),
            "evals": self.evals,
            "faults": self.faults,
        }
        uri = self.checkpoints.publish(step, local_dir, state, self._base_fingerprint)
        done = f"published to {uri}" if uri else "not published: the run is stopping"
        print(f"checkpoint step {step} {done}", flush=True)

    # -- training --------------------------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict:
        """train(), once per life of this actor: a caller that lost its answer while this life went on (in a
        network partition) asks again and gets the same training's outcome; a restarted life trains anew."""
        return self._once(self.train, resume)

    def train(self, resume: bool = False) -> dict:
        """Train to trainer.max_steps. `resume` (or a restart of this actor by Ray) continues from the
        newest verified checkpoint; adapter versions continue after the highest ever published."""
        self._imported.join()
        from rl_cluster.trainer.compat import apply_trainer_workarounds, train_to_max_steps

        apply_trainer_workarounds()
        c = self.config
        model_dir = resolve_model(c.model.path, c.model.revision)
        self._base_fingerprint = model_fingerprint(model_dir)
        checkpoint = self._resume_point(resume)
        self._wandb = start_wandb(c, self.bucket)
        dataset = load_prompts(c)
        self._build_trainer(model_dir, dataset)
        self._train_start = time.time()
        try:
            if train_to_max_steps(self.trainer, checkpoint) is None:
                print(
                    f"checkpoint step {self.resumed_from_step} is trainer.max_steps: nothing to train",
                    flush=True,
                )
        finally:
            self._write_metrics()
            if self._experience is not None:
                self._experience.close(timeout=60.0)
        return self.report()

    def _resume_point(self, resume: bool) -> str | None:
        """The checkpoint to continue from (its record restored), or None for a fresh start. A trainer Ray
        restarted continues like `resume`, from step 0 when no checkpoint was made yet."""
        c = self.config
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if not (resume or restarted):
            return None
        checkpoint, self.resumed_from_step = newest_checkpoint(
            self.bucket, c, self._base_fingerprint, required=resume
        )
        published = self.bucket.list_versions(c.run_name, c.run_name)
        print(resume_line(restarted, self.resumed_from_step, published), flush=True)
        if checkpoint:  # the run's record up to it; what happened after it is trained again
            state = read_state(checkpoint)
            self.history, self.syncs = state["history"], state["syncs"]
            self.evals, self.faults = state.get("evals", []), state.get("faults", [])
            done = state["groups"]  # groups in flight then are gone
            self._groups_before = {**done, "generated": done["trained"] + done["dropped_stale"]}
        if restarted:
            self._restarted = restart_fault(self.bucket, c.run_name, published, self.resumed_from_step)
            self.faults.append(self._restarted)
        return checkpoint

    def _build_trainer(self, model_dir: Path, dataset):
        """TRL's trainer, reporting here; the experience writer, the held-out eval and the check's prompt
        around it."""
        c = self.config
        self.trainer = build_trainer(
            c, model_dir, dataset, bucket=self.bucket, proxy=self.proxy, base_fingerprint=self._base_fingerprint,
            on_step=self._on_step, on_checkpoint=self._publish_checkpoint, on_sync=self._on_sync,
            on_sample=self._on_sample, stopping=self.checkpoints.stopping, fence=self.fence,
        )  # fmt: skip
        self._experience = experience_writer(c, self.bucket)
        if c.eval.every_steps:
            from rl_cluster.trainer.evaluation import EvalCallback

            self._evaluator = evaluator(c, self.trainer, self.proxy)
            # Added last: its hooks run after TRL's cold sync and after each step's sync.
            self.trainer.add_callback(EvalCallback(c.eval.every_steps, self._on_eval))
        self._check_prompt_ids = self.trainer.processing_class.apply_chat_template(
            dataset[0]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )

    def _group_counts(self) -> dict:
        if self.trainer is None:
            return dict(self._groups_before)
        now = self.trainer.group_counts()
        return {k: now[k] + self._groups_before.get(k, 0) for k in now}

    @ray.method(concurrency_group="control")
    def report(self) -> dict:
        """What the run did so far: callable while train() runs (the actor has a second thread for it),
        so a stopped or failed run still gets its summary."""
        return {
            "history": list(self.history),
            "evals": list(self.evals),
            "syncs": list(self.syncs),
            "checkpoints": list(self.checkpoints.uris),
            "train_wall_s": time.time() - self._train_start if self._train_start else 0.0,
            "groups": self._group_counts(),
            "resumed_from_step": self.resumed_from_step,
            "faults": list(self.faults),
            "experience": self._experience.stats() if self._experience is not None else None,
            "correction": self.config.trainer.correction,
        }

    @ray.method(concurrency_group="control")
    def stop(self) -> dict:
        """The run ends early (stopped, or failed elsewhere): no checkpoint is published after this (nor deleted
        by retention), and training ends at the step's end. Returns report(), with what the bucket keeps."""
        self.checkpoints.stop()
        return self.report()

    @ray.method(concurrency_group="control")
    def finish(self, summary: dict) -> None:
        """The run's summary to W&B, and its W&B run closed (the driver calls this once it summarised).
        metrics.jsonl once more: a stopped run's last steps are not on the bucket yet (written every 10)."""
        if self.history:
            self._write_metrics()
        if self._wandb is not None:
            self._wandb.finish(summary)
            if self._wandb.sync_dir and self.config.logging.wandb == "offline":
                print(f"wandb offline run: upload it with `wandb sync {self._wandb.sync_dir}`", flush=True)

    @ray.method(concurrency_group="control")
    def placement(self) -> dict:
        return node_placement()

    @ray.method(concurrency_group="lease")
    def lease_news(self, valid_for_s: float | None = None, lost: str | None = None) -> None:
        """The driver renewed the run's lease (held `valid_for_s` from when the renewal began), or lost it
        (`lost` says why): no write from here on, and training ends at the step's end."""
        if lost is not None:
            self.fence.lost(lost)
            self.checkpoints.stop()
        elif valid_for_s is not None:
            self.fence.renewed(valid_for_s)


# run() holds a thread for the whole run, and a run() asked again (after a partition: it waits for the
# first) one more. What the driver asks meanwhile has threads of its own: report(), stop(), finish() and
# placement() in "control", the lease's news in "lease" (held back, it would close the fence on a lease
# that is held).
TrainerActor = ray.remote(max_concurrency=2, concurrency_groups={"control": 2, "lease": 1})(Trainer)
