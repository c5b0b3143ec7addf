"""The run's trainer actor: the coordinator of the trainer's ranks, and the keeper of the run's record.

It runs on the driver's node and takes no `trainer` resource: Ray Train places the ranks on trainer nodes
(rl_cluster.trainer.gang) and restarts them as a gang; the ranks train and report here
(rl_cluster.trainer.rank). What the driver asks (train, report, stop, placement, the lease's news, finish)
is answered here, also while a gang restarts. The record outlives a rank: the progress lines, the W&B run
and metrics.jsonl are written from here, the checkpoints' record is read from here.
"""

from __future__ import annotations

import json
import os
import threading
import time

import ray

from rl_cluster.bucket import LEASE_TTL_S, Bucket
from rl_cluster.config import RunConfig, TrainerConfig
from rl_cluster.core.evaluation import with_evals
from rl_cluster.core.fence import WriteFence
from rl_cluster.core.summary import progress_line
from rl_cluster.errors import TrainingFailed
from rl_cluster.trainer.checkpoints import KeptCheckpoints
from rl_cluster.trainer.gang import fit_ranks
from rl_cluster.trainer.once import Once
from rl_cluster.trainer.records import Orders, RankHello, RankStart
from rl_cluster.trainer.wandb_log import start_wandb

PLACED_WAIT_S = 600.0  # placement() waits this long for rank 0 to start
GO_WAIT_S = 5.0  # a rank's rank_go() is answered at least this often while the run has not begun
# stop() waits for the rank to stop publishing: its checkpoint's wait, and one round of its orders.
STOPPED_WAIT_S = KeptCheckpoints.STOP_WAIT_S + 3.0


def _room(t: TrainerConfig) -> str:
    """The question to ask when no rank started: what the ranks need of the trainer nodes."""
    if t.span_nodes:
        return (f"do the trainer nodes have {t.num_workers} x (`trainer: 1`, {t.num_cpus:g} CPUs, {t.num_gpus:g} "
                "GPUs) free between them?")  # fmt: skip
    return (f"does one node have `trainer: {t.num_workers}`, {t.num_workers * t.num_cpus:g} CPUs and "
            f"{t.num_workers * t.num_gpus:g} GPUs free (the ranks go together; trainer.span_nodes lets them "
            "span nodes)?")  # fmt: skip


class Trainer:
    def __init__(self, config: RunConfig, proxy, proxy_token: str | None = None,
                 replica_key: str | None = None, environment: dict[str, str] | None = None):  # fmt: skip
        """`proxy`: the run's proxy actor (the ranks ask it where it serves); `proxy_token`: for it; `replica_key`: for the served-vs-trained check, which samples
        from each replica directly; `environment`: the driver's secrets (HF_TOKEN, WANDB_API_KEY). The
        ranks are started at once (they import the training stack while the generators start) and train
        once run() is asked."""
        os.environ.update(environment or {})  # WANDB_API_KEY: the W&B run is this actor's
        self.config, self.proxy = config, proxy
        self._secrets = {
            "proxy_token": proxy_token,
            "replica_key": replica_key,
            "environment": environment or {},
        }
        self.bucket = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url)
        self.fence = WriteFence(margin_s=LEASE_TTL_S / 4, first_news_s=LEASE_TTL_S / 2)  # metrics.jsonl
        self.history: list[dict] = []
        self.evals: list[dict] = []  # held-out evals (rl_cluster.core.evaluation records)
        self.syncs: list[dict] = []
        self.faults: list[dict] = []  # the gang's restarts by Ray Train
        self.checkpoints: list[str] = []  # what the current rank published and retention keeps
        self.resumed_from_step: int | None = None
        self._groups: dict = {}  # the run's group counts, as the rank last reported them
        self._experience: dict | None = None
        self._train_start: float | None = None
        self._restarted: dict | None = None  # the restart fault whose recovery the next step closes
        self._lock = threading.Lock()
        # A coordinator Ray restarted lost its record: its first gang resumes like a restarted one.
        self._attempts = 1 if ray.get_runtime_context().was_current_actor_reconstructed else 0
        self._ranks: dict[int, RankHello] = {}  # the newest start of each rank
        self.imported: tuple[str, ...] = ()  # what the waiting rank said it imported
        self._placed, self._go, self._stop, self._rank_stopped = (threading.Event() for _ in range(4))
        self._rank_live, self._resume = False, False
        self._error: str | None = None  # a rank's training error
        self._wandb = None
        self._once = Once()  # run(): one training per life of this actor, whoever asks how often
        self._fit_error: BaseException | None = None
        self._fit = threading.Thread(target=self._fit_ranks, name="fit-ranks", daemon=True)
        self._fit.start()

    def _fit_ranks(self) -> None:
        try:
            fit_ranks(self.config, self.proxy, ray.get_runtime_context().current_actor)
        except BaseException as e:  # noqa: BLE001  raised by run(), where the driver hears of it
            self._fit_error = e

    # -- the driver's calls ----------------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict:
        """Train to trainer.max_steps, once per life of this actor: a caller that lost its answer (in a
        network partition) asks again and gets the same training's outcome. `resume` continues from the
        newest verified checkpoint; so does a gang Ray Train restarted."""
        return self._once(self.train, resume)

    def train(self, resume: bool) -> dict:
        """The run begins: the waiting rank is told to train; its outcome when the gang has returned."""
        self._wandb = start_wandb(self.config, self.bucket)
        self._resume = resume
        self._go.set()
        self._fit.join()
        self._write_metrics()
        if self._error is not None:  # before the gang's own end: an aborted gang's is only its abort
            raise TrainingFailed(self._error)
        if self._fit_error is not None:
            raise self._fit_error
        return self.report()

    @ray.method(concurrency_group="control")
    def report(self) -> dict:
        """What the run did so far: callable while run() trains, so a stopped or failed run still gets
        its summary."""
        with self._lock:
            return {
                "history": list(self.history),
                "evals": list(self.evals),
                "syncs": list(self.syncs),
                "checkpoints": list(self.checkpoints),
                "train_wall_s": time.time() - self._train_start if self._train_start else 0.0,
                "groups": dict(self._groups),
                "resumed_from_step": self.resumed_from_step,
                "faults": list(self.faults),
                "experience": self._experience,
                "correction": self.config.trainer.correction,
                "trainer_restarts": max(self._attempts - 1, 0),
                "ranks": [hello.placement() for _, hello in sorted(self._ranks.items())],
            }

    @ray.method(concurrency_group="control")
    def stop(self) -> dict:
        """The run ends early (stopped, or failed elsewhere): the rank publishes no checkpoint after this
        (nor deletes one by retention), and training ends at the step's end. Returns report(), with what
        the bucket keeps."""
        self._stop.set()
        if self._rank_live:
            self._rank_stopped.wait(STOPPED_WAIT_S)
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
        """Where rank 0 runs (address, node_id, pid); waits for it to start."""
        if not self._placed.wait(PLACED_WAIT_S):
            raise RuntimeError(
                f"no trainer rank started within {PLACED_WAIT_S:.0f} s: {_room(self.config.trainer)}"
            )
        return self._ranks[0].placement()

    @ray.method(concurrency_group="lease")
    def lease_news(self, valid_for_s: float | None = None, lost: str | None = None) -> None:
        """The driver renewed the run's lease (held `valid_for_s` from when the renewal began), or lost it
        (`lost` says why): the ranks hear it with their next orders; a lost lease also stops the run."""
        if lost is not None:
            self.fence.lost(lost)
            self._stop.set()
        elif valid_for_s is not None:
            self.fence.renewed(valid_for_s)

    # -- the ranks' calls ------------------------------------------------------------------------------
    @ray.method(concurrency_group="rank")
    def rank_hello(self, hello: RankHello) -> None:
        """A rank started; rank 0's hello counts a start of the gang."""
        print(hello.line(), flush=True)
        with self._lock:
            self._ranks[hello.rank] = hello
            self._attempts += hello.rank == 0
        if hello.rank == 0:
            self._placed.set()

    @ray.method(concurrency_group="rank")
    def rank_go(self, imported: tuple[str, ...]) -> RankStart | None:
        """The run's start once the driver asked to train; None after GO_WAIT_S (the rank asks again).
        `imported`: the training stack's modules the rank holds already."""
        self.imported = imported
        if not self._go.wait(GO_WAIT_S):
            return None
        return RankStart(attempt=self._attempts - 1, resume=self._resume, **self._secrets)

    @ray.method(concurrency_group="rank")
    def rank_resumed(
        self, state: dict | None, step: int | None, groups_before: dict, fault: dict | None
    ) -> None:
        """The rank resumes from checkpoint `step` with its record `state` (None: from step 0, with
        nothing before); `fault`: Ray Train restarted the gang."""
        with self._lock:
            self.resumed_from_step, kept = step, state or {}
            self.history, self.syncs, self.evals = (
                kept.get("history", []),
                kept.get("syncs", []),
                kept.get("evals", []),
            )
            saved = kept.get("faults", [])
            seen = {(f["time"], f["what"]) for f in saved}
            self.faults = saved + [f for f in self.faults if (f["time"], f["what"]) not in seen]
            self._groups = dict(groups_before)
            if fault is not None:
                self._restarted = fault
                self.faults.append(fault)

    @ray.method(concurrency_group="rank")
    def rank_training(self) -> None:
        self._rank_live, self._train_start = True, self._train_start or time.time()
        self._rank_stopped.clear()

    @ray.method(concurrency_group="rank")
    def rank_step(self, record: dict, groups: dict, experience: dict | None) -> None:
        with self._lock:
            self._groups, self._experience = groups, experience
            if self.history and record["step"] <= self.history[-1]["step"]:
                return  # a trainer restored at its last step logs that step once more: the record has it
            self.history.append(record)
            if self._restarted is not None:
                self._restarted["recovered_s"] = round(time.time() - self._restarted["time"], 1)
                self._restarted = None
        print(progress_line(record, self.config.trainer.max_steps), flush=True)
        self._wandb.log_step(record["step"], record)
        if record["step"] % 10 == 0:
            self._write_metrics()

    @ray.method(concurrency_group="rank")
    def rank_sync(self, record: dict) -> None:
        self.syncs.append(record)

    @ray.method(concurrency_group="rank")
    def rank_eval(self, record: dict) -> None:
        with self._lock:
            if any(e["step"] == record["step"] for e in self.evals):
                return
            self.evals.append(record)
        self._wandb.log_eval(record)
        self._write_metrics()

    @ray.method(concurrency_group="rank")
    def rank_state(self, groups: dict) -> dict:
        """The run's record for a checkpoint (what a resume restores); metrics.jsonl written with it."""
        self._write_metrics()
        with self._lock:
            self._groups = groups
            return {
                "history": self.history,
                "syncs": self.syncs,
                "groups": groups,
                "evals": self.evals,
                "faults": self.faults,
            }

    @ray.method(concurrency_group="rank")
    def rank_checkpoints(self, uris: list[str]) -> None:
        self.checkpoints = uris  # one assignment: report() sees the old list or the new

    @ray.method(concurrency_group="rank")
    def rank_orders(self) -> Orders:
        left, lost = self.fence.news()  # the rank fences its own writes by the same news
        return Orders(stop=self._stop.is_set(), lease_left_s=left, lost=lost)

    @ray.method(concurrency_group="rank")
    def rank_stopped(self, uris: list[str]) -> None:
        """The rank heard the stop: it publishes no checkpoint from here on; `uris` is what it kept."""
        self.checkpoints = uris
        self._rank_stopped.set()

    @ray.method(concurrency_group="rank")
    def rank_done(self, groups: dict, experience: dict | None) -> None:
        self._groups, self._experience, self._rank_live = groups, experience, False
        self._rank_stopped.set()

    @ray.method(concurrency_group="rank")
    def rank_failed(self, error: str, gang=None) -> None:
        """A rank's training raised (run() raises it); `gang`: Train's controller, to abort ranks left waiting."""
        self._error = self._error or error
        if gang is not None:
            gang.abort.remote()

    def _write_metrics(self) -> None:
        if (refused := self.fence.refusal()) is not None:
            print(f"metrics.jsonl not written: {refused}", flush=True)
            return
        with self._lock:
            lines = "".join(json.dumps(r) + "\n" for r in with_evals(self.history, self.evals))
        self.bucket.write_text(self.config.run_name, "metrics.jsonl", lines)


def trainer_actor_class(num_workers: int = 1):
    """The coordinator as a Ray actor class for a gang of `num_workers` ranks (Ray sizes concurrency
    groups on the class, not in .options()).

    run() holds a thread for the whole run, and a run() asked again (after a partition: it waits for the
    first) one more. What the driver asks meanwhile has threads of its own: report(), stop(), finish() and
    placement() in "control", the lease's news in "lease" (held back, it would close the write fence); the
    ranks' calls in "rank": each rank waits in rank_go() at once, and rank 0 reports and asks for orders."""
    groups = {"control": 2, "lease": 1, "rank": num_workers + 2}
    return ray.remote(max_concurrency=2, concurrency_groups=groups)(Trainer)
