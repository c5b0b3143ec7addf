"""One rank of the run's trainer: TRL's AsyncGRPOTrainer built and trained in a process Ray Train runs
(`ray::RayTrainWorker`), reporting to the coordinator, the run's trainer actor (rl_cluster.trainer.actor).

The rank trains and does the I/O of training: adapter versions through the proxy, checkpoints into the
bucket, the served-vs-trained check, the held-out eval, the experience store, the Ray metrics of its node.
The coordinator keeps the run's record (steps, syncs, evals, faults), which outlives a rank: Ray Train
restarts a gang whose process or node died, and the new rank resumes from the newest checkpoint.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

import ray

from rl_cluster.bucket import LEASE_TTL_S, Bucket
from rl_cluster.config import RunConfig
from rl_cluster.core.evaluation import eval_line, eval_record
from rl_cluster.core.fence import WriteFence
from rl_cluster.core.gang_faults import peer_gone
from rl_cluster.core.manifest import adapter_dir_name
from rl_cluster.core.summary import step_record
from rl_cluster.core.telemetry import GROUP_FATES, TRAINER_METRICS, finite, step_values
from rl_cluster.models import model_fingerprint, resolve_model
from rl_cluster.telemetry import RayMetricSet
from rl_cluster.trainer.build import build_trainer, evaluator, experience_writer
from rl_cluster.trainer.check import ServedCheck
from rl_cluster.trainer.checkpoints import (
    KeptCheckpoints,
    newest_checkpoint,
    read_state,
    restart_fault,
    resume_line,
)
from rl_cluster.trainer.proxy_client import ProxyAddress, ProxyClient
from rl_cluster.trainer.records import Orders, RankHello, RankStart
from rl_cluster.trainer.rollout_server import start_rollout_server
from rl_cluster.trainer.task import load_prompts

# What a rank imports before the run begins (while the generators start): torch, transformers, TRL, PEFT.
TRAINING_STACK = (
    "torch",
    "peft",
    "trl.experimental.async_grpo.async_grpo_trainer",
    "rl_cluster.trainer.grpo",
)
ORDERS_EVERY_S = 1.0  # how often a rank asks the coordinator for a stop and the lease's news
CALL_TIMEOUT_S = 60.0  # a coordinator that does not answer a report in this long is gone (its node frozen)
PROXY_EVERY_S = 2.0  # how often rank 0 asks the proxy's actor where it serves


def rank_main(loop_config: dict) -> None:
    """Ray Train's function for each rank: say hello, import the training stack, wait for the run to
    begin, train. An error of the training is the coordinator's to report (and the run's to fail with),
    never a reason for Ray Train to restart the gang: only a rank's death is."""
    import importlib

    import ray.train

    coordinator = loop_config["coordinator"]
    context = ray.train.get_context()
    hello = RankHello(
        rank=context.get_world_rank(), world_size=context.get_world_size(),
        address=ray.util.get_node_ip_address(), node_id=ray.get_runtime_context().get_node_id(), pid=os.getpid(),
    )  # fmt: skip
    ray.get(coordinator.rank_hello.remote(hello))
    for module in TRAINING_STACK:
        importlib.import_module(module)
    imported = tuple(m for m in TRAINING_STACK if m in sys.modules)
    start = None
    while start is None:  # until the driver asks the coordinator to train (its generators serve then)
        start = ray.get(coordinator.rank_go.remote(imported))
    try:
        Rank(loop_config["config"], loop_config["proxy"], coordinator, start, hello).train()
    except Exception as e:
        traceback.print_exc()
        several = hello.world_size > 1
        if several and peer_gone(e):
            raise  # the gang's failure, not this rank's: Ray Train restarts the gang, as for the peer's death
        # The other ranks wait for this one in a collective: the coordinator ends the gang's run.
        who = f"rank {hello.rank}: " if several else ""
        ray.get(
            coordinator.rank_failed.remote(
                f"{who}{type(e).__name__}: {e}", train_controller() if several else None
            )
        )


class Rank:
    """Every rank builds TRL's trainer and joins its collectives (the step's gradients, the adapter's
    save, the stop); rank 0 alone pulls the rollouts and does the I/O and the reports."""

    def __init__(self, config: RunConfig, proxy, coordinator, start: RankStart, hello: RankHello):
        """`proxy`: the run's proxy actor, which says where it serves (rank 0 follows it when it moves)."""
        os.environ.update(start.environment)
        self.config, self.coordinator, self.start, self.hello = config, coordinator, start, hello
        self.main = hello.rank == 0
        self.proxy_actor = proxy
        self.proxy: ProxyClient | None = None  # once training begins (where the proxy serves then)
        self.bucket = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url)
        self.fence = WriteFence(  # before each write
            margin_s=LEASE_TTL_S / 4, first_news_s=LEASE_TTL_S / 2, on_refused=self._fenced
        )
        self._refused: str | None = None  # the first write the fence refused, and why
        self.checkpoints = KeptCheckpoints(self.bucket, config, self.fence)
        self.metrics = RayMetricSet(TRAINER_METRICS, config.run_name)
        self._served_check = ServedCheck(config)
        self.trainer = None
        self.last_sync: dict = {}
        self._eval_steps: set[int] = set()
        self._groups_before: dict = {}  # groups of the run before the checkpoint it resumed from
        self._base_fingerprint = ""
        self._check_prompt_ids: list[int] = []
        self._evaluator = None
        self._experience = None
        self._training = threading.Event()  # set while training: the orders are asked for meanwhile

    def _tell(self, method: str, *args):
        """A report to the coordinator, answered before training goes on (so a checkpoint's record holds
        every step before it)."""
        return ray.get(getattr(self.coordinator, method).remote(*args), timeout=CALL_TIMEOUT_S)

    # -- the run's orders ------------------------------------------------------------------------------
    def _follow_orders(self) -> None:
        """On its own thread while training: the lease's news into the write fence, and a stop asked for
        (by the driver, or by a lost lease) into the checkpoints' stop and TRL's step end."""
        told_stopped = False
        while self._training.is_set():
            try:
                orders: Orders = ray.get(self.coordinator.rank_orders.remote(), timeout=CALL_TIMEOUT_S)
            except Exception as e:  # no news: the fence closes by itself when the lease's time runs out
                print(f"trainer: no orders from the coordinator ({type(e).__name__}: {e})", flush=True)
                time.sleep(ORDERS_EVERY_S)
                continue
            if orders.lost is not None:
                self.fence.lost(orders.lost)
            elif orders.lease_left_s is not None:
                self.fence.renewed(orders.lease_left_s)
            if (orders.stop or orders.lost is not None) and not told_stopped:
                self.checkpoints.stop()
                self._tell("rank_stopped", list(self.checkpoints.uris))
                told_stopped = True
            time.sleep(ORDERS_EVERY_S)

    def _fenced(self, refused: str) -> None:
        """Rank 0's fence refused a write: training ends at the end of this step on every rank (the stop
        is all-reduced), writing nothing more, and the run fails with why."""
        if self._refused is None:
            self._refused = refused
            print(f"trainer: {refused}; training stops at the end of this step", flush=True)
        self.checkpoints.stopping.set()  # not stop(): this may run inside a checkpoint's publish, its lock held

    # -- reporting -------------------------------------------------------------------------------------
    def _group_counts(self) -> dict:
        now = self.trainer.group_counts()
        return {k: now[k] + self._groups_before.get(k, 0) for k in now}

    def _on_step(self, step: int, logs: dict) -> None:
        if not self.main:  # TRL logs on every rank; rank 0's record is the run's
            return
        record = step_record(step, logs, self.trainer.model_version, self.last_sync.get("handoff_s"))
        gauges, observed = step_values(record)
        for name, value in gauges.items():
            self.metrics.set(name, value)
        for name, value in observed.items():
            self.metrics.observe(name, value)
        counts = self._group_counts()
        for fate in GROUP_FATES:
            self.metrics.set("rl_trainer_groups", counts[fate], fate=fate)
        experience = self._experience.stats() if self._experience is not None else None
        self._tell("rank_step", record, counts, experience)

    def _on_sync(self, version: int, name: str, timings: dict) -> None:
        """Every rank after each sync: rank 0 checks the version and reports it; under FSDP2 the others
        compute the check's forwards with it."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        if not self.main:
            if self._served_check.lockstep:
                self._served_check.join(model)
            return
        record = {"version": version, "adapter": name, **timings}
        record.update(
            self._served_check.run(
                model, version, self.proxy.active_replica_urls, name, self._check_prompt_ids,
                api_key=self.start.replica_key,
            )
        )  # fmt: skip
        self.last_sync = record
        self.metrics.observe("rl_trainer_handoff_seconds", timings["handoff_s"])
        if "check" in record:
            self.metrics.set("rl_trainer_served_vs_trained_gap", record["served_vs_trained_gap"])
            self.metrics.set(
                "rl_trainer_served_vs_trained_floor", max(r["floor"] for r in record["check"]["replicas"])
            )
        self._tell("rank_sync", record)

    def _on_sample(self, sample, trainer_version: int, trained: bool) -> None:
        """Every sample the trainer pulls, on the training thread: keep it cheap."""
        self.metrics.observe("rl_trainer_staleness", trainer_version - sample.model_version)
        if self._experience is not None:
            self._experience.add(sample, trainer_version=trainer_version, trained=trained)

    def _on_eval(self, step: int) -> None:
        """Eval of the newest version on the held-out split (rl_cluster.trainer.evaluation); once per step
        (a resumed run's train-begin eval repeats none it already has)."""
        if step in self._eval_steps:
            return
        self._eval_steps.add(step)
        version = self.trainer.model_version
        adapter = adapter_dir_name(self.config.run_name, version)
        start = time.time()
        scores = self._evaluator.run(adapter)
        record = eval_record(step, adapter, version, scores, time.time() - start)
        print(eval_line(record), flush=True)
        for score in ("pass@1", "mean@k"):
            if (value := finite(record.get(score))) is not None:
                self.metrics.set("rl_trainer_eval", value, score=score)
        self._tell("rank_eval", record)

    def _publish_checkpoint(self, step: int, local_dir: str) -> None:
        state = self._tell("rank_state", self._group_counts())  # metrics.jsonl is written with it
        uri = self.checkpoints.publish(step, local_dir, state, self._base_fingerprint)
        done = f"published to {uri}" if uri else "not published: the run is stopping"
        print(f"checkpoint step {step} {done}", flush=True)
        self._tell("rank_checkpoints", list(self.checkpoints.uris))

    # -- training --------------------------------------------------------------------------------------
    def train(self) -> None:
        """Train to trainer.max_steps. A resume (the driver's --resume, or a gang Ray Train restarted)
        continues from the newest verified checkpoint; adapter versions continue after the highest ever
        published."""
        from rl_cluster.trainer.compat import apply_trainer_workarounds, train_to_max_steps

        apply_trainer_workarounds()
        if self.main:
            start_rollout_server()
        c = self.config
        model_dir = resolve_model(c.model.path, c.model.revision)
        self._base_fingerprint = model_fingerprint(model_dir)
        checkpoint, resumed_from_step = self._resume_point()
        dataset = load_prompts(c)
        token = self.start.proxy_token or (
            c.proxy.auth_token.get_secret_value() if c.proxy.auth_token else None
        )
        self.proxy = ProxyClient(ProxyAddress(proxy_address(self.proxy_actor)), token)
        self._build_trainer(model_dir, dataset)
        if not self.main:
            train_to_max_steps(self.trainer, checkpoint)  # rank 0 tells when it stops, and what
            return
        self._training.set()
        orders = threading.Thread(target=self._follow_orders, name="trainer-orders", daemon=True)
        orders.start()
        follow = (self.proxy_actor, self.proxy.address, self._training)
        threading.Thread(target=follow_proxy, args=follow, name="trainer-proxy", daemon=True).start()
        self._tell("rank_training")
        try:
            if train_to_max_steps(self.trainer, checkpoint) is None:
                print(
                    f"checkpoint step {resumed_from_step} is trainer.max_steps: nothing to train", flush=True
                )
            if self._refused is not None:
                self._tell("rank_failed", f"LeaseLost: {self._refused}")
        finally:
            self._training.clear()
            if self._experience is not None:
                self._experience.close(timeout=60.0)
            experience = self._experience.stats() if self._experience is not None else None
            self._tell("rank_done", self._group_counts(), experience)
            orders.join(timeout=2 * ORDERS_EVERY_S + CALL_TIMEOUT_S)

    def _resume_point(self) -> tuple[str | None, int | None]:
        """The checkpoint to continue from (its record restored at the coordinator), or None for a fresh
        start. A gang Ray Train restarted continues like `resume`, from step 0 when no checkpoint was made.
        Rank 0 chooses it; every rank resumes from the same step, each from its own copy."""
        c, restarted = self.config, self.start.attempt > 0
        if not (self.start.resume or restarted):
            return None, None
        checkpoint, step = self._newest_checkpoint() if self.main else (None, None)
        if self.hello.world_size > 1:
            import torch.distributed as dist

            chosen = [step]
            dist.broadcast_object_list(chosen, src=0)
            step = chosen[0]
            if not self.main and step is not None:
                checkpoint = str(self.bucket.fetch_checkpoint(
                    self.bucket.checkpoint_uri(c.run_name, step), base_fingerprint=self._base_fingerprint,
                    cache_dir=Path(c.bucket.cache_dir, f".rank-{self.hello.rank}"),  # its own copy (S3)
                ))  # fmt: skip
        return checkpoint, step

    def _newest_checkpoint(self) -> tuple[str | None, int | None]:
        """Rank 0's choice: the newest verified checkpoint, its record told to the coordinator."""
        c, restarted = self.config, self.start.attempt > 0
        checkpoint, step = newest_checkpoint(
            self.bucket, c, self._base_fingerprint, required=self.start.resume
        )
        published = self.bucket.list_versions(c.run_name, c.run_name)
        print(resume_line(restarted, step, published), flush=True)
        state = read_state(checkpoint) if checkpoint else None
        if state is not None:
            done = state["groups"]  # groups in flight then are gone
            self._groups_before = {**done, "generated": done["trained"] + done["dropped_stale"]}
            self._eval_steps = {e["step"] for e in state.get("evals", [])}
        fault = restart_fault(self.bucket, c.run_name, published, step) if restarted else None
        self._tell("rank_resumed", state, step, self._groups_before, fault)
        return checkpoint, step

    def _build_trainer(self, model_dir: Path, dataset):
        """TRL's trainer, reporting here; rank 0's experience writer, held-out eval and check's prompt around
        it."""
        c = self.config
        self.trainer = build_trainer(
            c, model_dir, dataset, bucket=self.bucket, proxy=self.proxy, base_fingerprint=self._base_fingerprint,
            on_step=self._on_step, on_checkpoint=self._publish_checkpoint, on_sync=self._on_sync,
            on_sample=self._on_sample, stopping=self.checkpoints.stopping, fence=self.fence,
        )  # fmt: skip
        if not self.main:
            return
        self._experience = experience_writer(c, self.bucket)
        if c.eval.every_steps:
            from rl_cluster.trainer.evaluation import EvalCallback

            self._evaluator = evaluator(c, self.trainer, self.proxy)
            # Added last: its hooks run after TRL's cold sync and after each step's sync.
            self.trainer.add_callback(EvalCallback(c.eval.every_steps, self._on_eval))
        self._check_prompt_ids = self.trainer.processing_class.apply_chat_template(
            dataset[0]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )


def proxy_address(proxy, wait_s: float = 180.0) -> str:
    """Where the proxy serves, asked of its actor; waits (bounded) while Ray restarts it and the pool
    controller restores it, as the control calls wait for a proxy that does not answer."""
    deadline = time.monotonic() + wait_s
    while (url := ray.get(proxy.address.remote(), timeout=wait_s)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the run's proxy did not serve within {wait_s:g} s (Ray restarted it)")
        time.sleep(1.0)
    return url


def follow_proxy(proxy, address: ProxyAddress, training: threading.Event) -> None:
    """Rank 0, on its own thread while training: where the proxy's actor says it serves. Ray restarts a
    proxy whose node was lost on another `proxy` node, at that node's address; the control calls, the eval
    and the rollout child (through its position) go there from their next try."""
    while training.is_set():
        try:
            url = ray.get(proxy.address.remote(), timeout=CALL_TIMEOUT_S)
        except Exception:  # gone for now (Ray restarts it; its calls wait for that): ask again
            url = None
        if url is not None and address.move(url):
            print(f"trainer: the proxy serves on {url} now; following it there", flush=True)
        time.sleep(PROXY_EVERY_S)


def train_controller():
    """Ray Train's controller of the calling rank's gang, whose abort() ends the run with no restart: an
    error of the training on one rank, while the others wait for it in a collective. Ray 2.60 gives a rank
    no public call for that (an exception restarts the gang), so this reads the rank's own Train context."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().controller_actor
