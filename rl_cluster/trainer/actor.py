"""TrainerActor: builds TRL's AsyncGRPOTrainer for a run config and trains against the proxy."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import ray

from rl_cluster.bucket import Bucket
from rl_cluster.config import RunConfig
from rl_cluster.core.admission import AdmissionWindow
from rl_cluster.core.evaluation import eval_line, eval_record, with_evals
from rl_cluster.core.manifest import adapter_dir_name
from rl_cluster.core.summary import progress_line, step_record
from rl_cluster.core.telemetry import GROUP_FATES, TRAINER_METRICS, finite, step_values
from rl_cluster.models import model_fingerprint, resolve_model
from rl_cluster.nodes import node_placement
from rl_cluster.telemetry import RayMetricSet
from rl_cluster.trainer.check import served_vs_trained_gap
from rl_cluster.trainer.proxy_client import ProxyClient
from rl_cluster.trainer.task import import_function, load_prompts

RUN_STATE = "rl_cluster_state.json"  # in each checkpoint: the run's record up to it


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
        self.checkpoints: list[str] = []
        # The trainer's restarts by Ray, as summary.json's `faults` lists them; the open one (this life's)
        # closes at the first step trained after it.
        self.faults: list[dict] = []
        self._restarted: dict | None = None
        self._base_fingerprint = ""
        self.trainer = None
        self._check_prompt_ids: list[int] = []
        self._train_start: float | None = None
        self.resumed_from_step: int | None = None
        self._groups_before: dict = {}  # groups of the run before the checkpoint it resumed from
        self._checked = False
        self.metrics = RayMetricSet(TRAINER_METRICS, config.run_name)
        self._wandb = None
        self._experience = None  # rl_cluster.experience.ExperienceWriter, made with the trainer
        # run(): one train() per life of this actor, whoever asks how often.
        self._run_lock = threading.Lock()
        self._running = False
        self._outcome: threading.Event = threading.Event()
        self._result: dict | None = None
        self._error: BaseException | None = None

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
        lines = "".join(json.dumps(r) + "\n" for r in with_evals(self.history, self.evals))
        self.bucket.write_text(self.config.run_name, "metrics.jsonl", lines)

    def _on_sync(self, version: int, name: str, timings: dict) -> None:
        record = {"version": version, "adapter": name, **timings}
        check = self.config.check
        # The first sync of every trainer process is checked (a restarted one may never reach a multiple).
        if version % check.every_syncs == 0 or not self._checked:
            self._checked = True
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
            if gaps:
                record["served_vs_trained_gap"] = max(gaps.values())
            if gaps and not record["served_vs_trained_gap"] <= check.tolerance:
                print(
                    "\n" + "!" * 100 + f"\n!!! SERVED != TRAINED: {name} logprob gap {gaps} exceeds "
                    f"{check.tolerance}. The replicas do not serve the adapter the trainer trained; importance "
                    "ratios of this run are wrong.\n" + "!" * 100 + "\n",
                    flush=True,
                )
        self.syncs.append(record)
        self.last_sync = record
        self.metrics.observe("rl_trainer_handoff_seconds", timings["handoff_s"])
        if "served_vs_trained_gap" in record:
            self.metrics.set("rl_trainer_served_vs_trained_gap", record["served_vs_trained_gap"])

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
        (Path(local_dir) / RUN_STATE).write_text(json.dumps(state))  # what a resume restores besides TRL's
        uri = self.bucket.publish_checkpoint(
            self.config.run_name,
            step,
            local_dir,
            base_model=self.config.model.path,
            base_fingerprint=self._base_fingerprint,
        )
        shutil.rmtree(local_dir, ignore_errors=True)  # the bucket holds it now
        deleted = self.bucket.apply_checkpoint_retention(
            self.config.run_name, keep_last=self.config.trainer.keep_checkpoints
        )
        # summary.json lists what a resume can still use, not what retention already deleted.
        gone = {self.bucket.checkpoint_uri(self.config.run_name, step) for step in deleted}
        self.checkpoints = [kept for kept in self.checkpoints if kept not in gone] + [uri]
        print(f"checkpoint step {step} published to {uri}", flush=True)

    # -- training --------------------------------------------------------------------------------------
    def _newest_checkpoint(self, required: bool) -> tuple[str | None, int | None]:
        """(local directory, step) of the newest checkpoint of this run that verifies against its
        manifest. A damaged one is quarantined (out of the listing, retention and the way of the step's
        next publication) and the one before it is tried; one that does not fit (another base model) is
        skipped but left alone: the run's config may be what is wrong."""
        from rl_cluster.errors import AdapterNotFound, AdapterRejected, FilesDiffer

        run = self.config.run_name
        for step in reversed(self.bucket.list_checkpoints(run)):
            try:
                local = self.bucket.fetch_checkpoint(
                    self.bucket.checkpoint_uri(run, step),
                    cache_dir=self.config.bucket.cache_dir,
                    base_fingerprint=self._base_fingerprint,
                )
            except FilesDiffer as e:
                where = self.bucket.quarantine_checkpoint(run, step)
                print(f"checkpoint step {step} is damaged ({e}): moved to {where}; trying the one before",
                      flush=True)  # fmt: skip
                continue
            except (AdapterRejected, AdapterNotFound) as e:
                print(f"checkpoint step {step} is not usable ({e}); trying the one before", flush=True)
                continue
            return str(local), step
        if required:
            raise RuntimeError(
                f"{self.bucket.run_uri(run)} holds no verified checkpoint to resume from: run with "
                "trainer.checkpoint_every > 0 to make some, or start a new run"
            )
        return None, None

    def _restore(self, checkpoint: str) -> None:
        """The run's record up to the checkpoint (steps, syncs, groups), from the state it was saved with;
        what happened after it is trained again. Groups that were in flight then are gone."""
        state = json.loads((Path(checkpoint) / RUN_STATE).read_text())
        self.history, self.syncs = state["history"], state["syncs"]
        self.evals = state.get("evals", [])
        self.faults = state.get("faults", [])
        done = state["groups"]
        self._groups_before = {**done, "generated": done["trained"] + done["dropped_stale"]}

    def run(self, resume: bool = False) -> dict:
        """train(), once per life of this actor: a caller that lost its answer while this life went on (the
        driver's call failed in a network partition, not in a restart) asks again and gets the outcome of
        the same training, never a second one beside it. A life Ray restarted trains (and resumes) anew."""
        with self._run_lock:
            first, self._running = not self._running, True
        if first:
            try:
                self._result = self.train(resume)
            except BaseException as e:
                self._error = e
            finally:
                self._outcome.set()
        self._outcome.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def train(self, resume: bool = False) -> dict:
        """Train to trainer.max_steps. `resume` (or a restart of this actor by Ray) continues from the
        newest verified checkpoint; adapter versions continue after the highest ever published."""
        from rl_cluster.trainer.compat import apply_trainer_workarounds, train_to_max_steps

        apply_trainer_workarounds()
        c = self.config
        model_dir = resolve_model(c.model.path, c.model.revision)
        self._base_fingerprint = model_fingerprint(model_dir)
        checkpoint = self._resume_point(resume)
        self._start_wandb()
        dataset = load_prompts(c)
        self.trainer = self._build_trainer(model_dir, dataset)
        self._add_run_extras(dataset)
        self._train_start = time.time()
        try:
            if train_to_max_steps(self.trainer, checkpoint) is None:
                print(
                    f"checkpoint step {self.resumed_from_step} is trainer.max_steps: nothing left to train",
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
        checkpoint, self.resumed_from_step = self._newest_checkpoint(required=resume)
        published = self.bucket.list_versions(c.run_name, c.run_name)
        print(
            ("trainer restarted by Ray: " if restarted else "")
            + (
                f"resuming from checkpoint step {self.resumed_from_step}"
                if checkpoint
                else "no checkpoint yet: from step 0"
            )
            + f"; versions continue after v{max(published, default=0)}",
            flush=True,
        )
        if checkpoint:
            self._restore(checkpoint)
        if restarted:
            self._restarted = self._restart_fault(published)
            self.faults.append(self._restarted)
        return checkpoint

    def _restart_fault(self, published: list[int]) -> dict:
        """This life's restart as a fault: since the dead trainer's last sign of life (its newest published
        version, by its manifest's time; this life's start when it published none), until the first step
        this one trains."""
        c = self.config
        began = time.time()
        if published:
            with contextlib.suppress(Exception):  # a missing or odd manifest: the restart's own time
                name = adapter_dir_name(c.run_name, max(published))
                manifest = json.loads(self.bucket.read_text(c.run_name, f"adapters/{name}/manifest.json"))
                began = datetime.fromisoformat(manifest["created_at"]).timestamp()
        step = self.resumed_from_step
        what = f"trainer restarted by Ray ({f'from checkpoint step {step}' if step else 'from step 0'})"
        return {"time": round(began, 3), "what": what, "who": "trainer", "recovered_s": None}

    def _start_wandb(self) -> None:
        from rl_cluster.trainer.wandb_log import WandbLog

        c = self.config
        # Offline runs land beside the run's files when the bucket is a directory every node mounts, else
        # under the trainer's .cache/ (beside the vLLM logs), never loose in the working directory.
        local = Path(".cache", "wandb", c.run_name).resolve()
        self._wandb = WandbLog(c, local if self.bucket.is_remote else self.bucket.run_uri(c.run_name))
        if self._wandb.sync_dir:
            print(f"wandb ({c.logging.wandb}): {self._wandb.sync_dir}", flush=True)

    def _grpo_args(self, admission: AdmissionWindow):
        from trl.experimental.async_grpo import AsyncGRPOConfig

        from rl_cluster.trainer.compat import pipeline_limits, training_precision_kwargs

        c, t = self.config, self.config.trainer
        return AsyncGRPOConfig(
            output_dir=tempfile.mkdtemp(prefix=f"rl_cluster-{c.run_name}-"),
            vllm_server_base_url=self.proxy_url,
            learning_rate=t.learning_rate,
            lr_scheduler_type=t.lr_scheduler,
            adam_beta2=t.adam_beta2,
            num_generations=t.num_generations,
            per_device_train_batch_size=t.completions_per_step,
            max_completion_length=t.max_new_tokens,
            temperature=t.temperature,
            max_staleness=t.max_staleness,
            **pipeline_limits(admission, t.num_generations),
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

    def _build_trainer(self, model_dir: Path, dataset):
        """TRL's AsyncGRPOTrainer with the run's LoRA, rewards, callbacks and admission window."""
        from peft import LoraConfig

        from rl_cluster.trainer.compat import quiet_default_printer
        from rl_cluster.trainer.grpo import BucketSyncTrainer, CheckpointPublisher, StepReporter

        c, t = self.config, self.config.trainer
        admission = AdmissionWindow.for_trainer(
            t.completions_per_step,
            t.num_generations,
            t.sync_every,
            t.max_staleness,
            lockstep=t.mode == "sync",
        )
        lora = LoraConfig(
            r=c.lora.rank,
            lora_alpha=c.lora.alpha,
            target_modules=c.lora.target_modules,
            lora_dropout=c.lora.dropout,
            task_type="CAUSAL_LM",
        )
        trainer = BucketSyncTrainer(
            model=str(model_dir),
            reward_funcs=[import_function(r) for r in c.task.rewards],
            args=self._grpo_args(admission),
            train_dataset=dataset,
            peft_config=lora,
            callbacks=[StepReporter(self._on_step), CheckpointPublisher(self._publish_checkpoint)],
            run_name=c.run_name,
            bucket=self.bucket,
            proxy=self.proxy,
            base_model=c.model.path,
            base_fingerprint=self._base_fingerprint,
            keep_every=c.bucket.keep_every,
            on_sync=self._on_sync,
            on_sample=self._on_sample,
            admission=admission,
            first_version=max(self.bucket.list_versions(c.run_name, c.run_name), default=0) + 1,
        )
        quiet_default_printer(trainer)
        return trainer

    def _add_run_extras(self, dataset) -> None:
        """The experience writer, the held-out eval and the check's prompt, around the built trainer."""
        c, t = self.config, self.config.trainer
        if c.experience.enabled:
            from rl_cluster.experience import ExperienceWriter

            self._experience = ExperienceWriter(
                self.bucket,
                c.run_name,
                c.run_name,
                num_generations=t.num_generations,
                shard_groups=c.experience.shard_groups,
            )
        if c.eval.every_steps:
            from rl_cluster.data import load_prepared
            from rl_cluster.trainer.evaluation import EvalCallback, Evaluator

            self._evaluator = Evaluator(
                c,
                self.proxy_url,
                self.trainer.processing_class,
                import_function(c.task.rewards[0]),
                load_prepared(c, "eval").to_list(),
                chat_template_kwargs=self.trainer.args.chat_template_kwargs,
                auth_token=self.proxy.auth_token,
            )
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

    def report(self) -> dict:
        """What the run did so far: callable while train() runs (the actor has a second thread for it),
        so a stopped or failed run still gets its summary."""
        return {
            "history": list(self.history),
            "evals": list(self.evals),
            "syncs": list(self.syncs),
            "checkpoints": list(self.checkpoints),
            "train_wall_s": time.time() - self._train_start if self._train_start else 0.0,
            "groups": self._group_counts(),
            "resumed_from_step": self.resumed_from_step,
            "faults": list(self.faults),
            "experience": self._experience.stats() if self._experience is not None else None,
        }

    def finish(self, summary: dict) -> None:
        """The run's summary to W&B, and its W&B run closed (the driver calls this once it summarised)."""
        if self._wandb is not None:
            self._wandb.finish(summary)
            if self._wandb.sync_dir and self.config.logging.wandb == "offline":
                print(f"wandb offline run: upload it with `wandb sync {self._wandb.sync_dir}`", flush=True)

    def placement(self) -> dict:
        return node_placement()


# Two threads: run() holds one for the whole run; report(), placement() and a second run() (which waits
# for the first) answer on the other.
TrainerActor = ray.remote(max_concurrency=2)(Trainer)
