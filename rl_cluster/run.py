"""A run, start to end: what `jobs/train_grpo.py` does once it parsed its arguments.

    train(config) -> summary      the whole training run; `exit_status(summary)` is the process's status

(`jobs/serve.py`, the generators behind the proxy without training, is rl_cluster.serve.)

A run ends in one of three ways, and writes `summary.json` in each: finished, stopped (SIGTERM from `ray
job stop`, or Ctrl-C) or failed (an exception anywhere). The summary is written *before* the actors are
stopped: `ray job stop` SIGKILLs the driver a few seconds after its SIGTERM (RAY_JOB_STOP_WAIT_TIME_S,
3 s by default), and then the vLLM servers are ended by their watchdogs, but nothing would write what
the run did. Everything heavy (Ray, torch via the actors) is imported inside the functions, so a
config error is reported before any of it loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import traceback
from collections.abc import Awaitable
from dataclasses import astuple

from rl_cluster.config import RunConfig
from rl_cluster.core.summary import NEVER_DEDUPLICATED, exit_status, summarize, summary_table
from rl_cluster.credentials import RunSecrets
from rl_cluster.errors import RunRefused
from rl_cluster.trainer_calls import LeaseNews, train_through_restarts, trainer_actor

# Read by Ray when it is imported (below, inside the functions): every progress line reaches the logs.
os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", NEVER_DEDUPLICATED)

# Bounded waits for what the summary needs from actors that may be busy or gone.
REPORT_TIMEOUT_S = 20.0


class RunStopped(Exception):
    """SIGTERM or SIGINT arrived: end the run, keep what it did."""


def on_signals(callback) -> None:
    """Call `callback` on SIGINT or SIGTERM. After ray.init: it installs a SIGTERM handler of its own
    (sys.exit), which would skip every cleanup."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, callback)


class RunStop:
    """Called on a stop (a signal, `ray job stop`) or the lease's loss: the first cancels the run's task while
    it trains; later ones, and any once the run is `ending` (its summary and cleanup under way), interrupt
    nothing. A frozen driver, thawed, hears both its trainer's end and its lease's loss at once: the loss
    cancelled the summary, and the driver died in a traceback with no summary printed."""

    def __init__(self, task: asyncio.Task):
        self.task, self.ending = task, False

    def __call__(self) -> None:
        if self.ending or self.task.cancelling():
            print("already stopping: summary first, then every process", flush=True)
        else:
            self.task.cancel()


def failure(error: Exception) -> str:
    """What the summary says of the error that ended a run: an actor's arrives wrapped in Ray's RayTaskError,
    whose message is the actor's whole traceback (the log shows it); the summary names the actor's error."""
    import ray.exceptions

    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, Exception):
        error = error.cause
    return f"{type(error).__name__}: {error}"


async def _bounded(awaitable: Awaitable, default):
    """What an actor call returns, or `default` when the actor is gone or does not answer in time."""
    try:
        return await asyncio.wait_for(awaitable, REPORT_TIMEOUT_S)
    except Exception as e:
        print(f"  (could not collect it: {type(e).__name__}: {e})", flush=True)
        return default


async def _now(value):
    return value


def check_fresh_run_name(bucket, run_name: str) -> None:
    if bucket.list_versions(run_name, run_name):
        raise RunRefused(
            f"{bucket.run_uri(run_name)} already holds adapters of a run named {run_name!r}: adapter names are "
            "never reused (vLLM keys its prefix cache by name). Pick another run_name."
        )


def log_dir_for(config: RunConfig) -> str:
    return os.path.abspath(os.path.join(".cache", "logs", config.run_name))


def check_resumable(bucket, run_name: str) -> None:
    if not bucket.list_checkpoints(run_name):
        raise RunRefused(
            f"{bucket.run_uri(run_name)} holds no checkpoint of a run named {run_name!r}: nothing to resume "
            "(a run makes checkpoints with trainer.checkpoint_every > 0). Check the name and bucket.uri."
        )


async def train(config: RunConfig, resume: bool = False) -> dict:
    """Launch the generators and the proxy, train, summarise, stop everything. Never leaves a process.
    `resume`: continue the run named config.run_name from its newest verified checkpoint.

    First of all the run's lease (rl_cluster/bucket/lease.py): LeaseHeld while another driver runs this
    run_name, before Ray or anything else starts. It is renewed while the run lives and released however
    the run ends; a driver whose lease is taken over stops its run as failed."""
    from rl_cluster.bucket import Bucket

    bucket = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url)
    lease = bucket.run_lease(config.run_name)
    lease.acquire()  # before the checks in _train: they are check-then-act, safe only under the lease
    loop, stop = asyncio.get_running_loop(), RunStop(asyncio.current_task())
    news = LeaseNews()

    def lost(why: str) -> None:
        news.lost(why)  # the trainer stops writing first, then the run stops
        loop.call_soon_threadsafe(stop)

    lease.start_renewing(lost, news.renewed)
    on_signals(stop)  # from here on a stop ends the run at its next await, summary.json first
    try:
        return await _train(config, bucket, lease, news, resume, stop)
    finally:
        lease.release()


async def _train(config: RunConfig, bucket, lease, news: LeaseNews, resume: bool, stop: RunStop) -> dict:
    import ray

    from rl_cluster.cluster import start_proxy
    from rl_cluster.connection import check_placeable, connect
    from rl_cluster.plots import curves_png  # noqa: F401  imported now: matplotlib takes seconds, and
    from rl_cluster.pool import start_pool  # after `ray job stop` there are 3 (_summarize_run uses it)

    if resume:
        check_resumable(bucket, config.run_name)
    else:
        check_fresh_run_name(bucket, config.run_name)
    # SecretStr fields dump as '**********': the resolved config holds no token.
    name = "config.resolved.json" if not resume else f"config.resumed-{time.strftime('%Y%m%d-%H%M%S')}.json"
    bucket.write_text(config.run_name, name, config.model_dump_json(indent=2))
    start, status, error, cluster = time.time(), "finished", None, None
    result = {"history": [], "syncs": [], "checkpoints": []}
    try:
        loopback, dashboard = connect(config)
        on_signals(stop)  # again: ray.init put its own SIGTERM handler in
        if not loopback:  # a private local Ray declared the resources itself
            await check_placeable(config)  # RunRefused in seconds where no node can ever hold an actor
        secrets = RunSecrets.for_run(config)
        starting = f"starting {config.generator.replicas} generators and the proxy"
        print(f"run {config.run_name}: {starting}", flush=True)
        cluster = await start_proxy(config, log_dir_for(config), secrets, loopback=loopback)
        # Its process starts (imports torch, transformers, TRL) beside the vLLM servers; the cleanup ends both.
        cluster.trainer = news.trainer = trainer_actor(config, cluster.proxy, secrets)
        cluster.trainer.lease_news.remote(valid_for_s=lease.valid_for())
        await cluster.add_generators(config.generator.replicas)
        cluster.pool = await start_pool(cluster)
        ready = f"proxy listening on {cluster.proxy_url}; generators ready after {time.time() - start:.0f}s"
        print(ready, flush=True)
        cluster.placement["trainer"] = await cluster.trainer.placement.remote()
        _print_where(cluster.placement, dashboard)
        result = await train_through_restarts(cluster.trainer, resume)
    except RunRefused:
        with contextlib.suppress(Exception):
            ray.shutdown()
        raise  # nothing started: no summary, exit status 2 (rl_cluster.commands.guarded)
    except (asyncio.CancelledError, SystemExit):  # SystemExit: ray.init's own SIGTERM handler, during connect
        asyncio.current_task().uncancel()  # the stop is handled here; the cleanup's awaits must run
        status, error = _stopped(config, lease)
    except Exception as e:
        status, error = "failed", failure(e)
        print(f"\nrun {config.run_name} failed: {error}", flush=True)
        traceback.print_exc()  # the summary keeps the message; the log keeps where it happened
    stop.ending = True
    try:
        # After the lease was lost another driver may hold the run: nothing more of this one is written.
        writable = bucket if lease.lost is None else None
        summary = await _summarize_run(config, writable, cluster, result, status, error, time.time() - start)
    finally:
        if cluster is not None:
            await cluster.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
    print(f"\nrun {config.run_name} {status}\n{summary_table(summary)}", flush=True)
    _print_written(config, bucket, lease, summary)
    return summary


def _print_written(config: RunConfig, bucket, lease, summary: dict) -> None:
    if lease.lost is not None:
        print(
            f"\nnothing written to {bucket.run_uri(config.run_name)}/: this driver lost the run's lease",
            flush=True,
        )
        return
    # metrics.jsonl and curves.png exist once a step was trained (a run can fail before its first).
    written = ["summary.json", *(["metrics.jsonl", "curves.png"] if summary["steps"] else [])]
    print(f"\nwritten to {bucket.run_uri(config.run_name)}/ ({', '.join(written)})", flush=True)


def _stopped(config: RunConfig, lease) -> tuple[str, str | None]:
    """The status and error of a run cancelled by a stop (a signal, `ray job stop`) or by a lost lease."""
    if lease.lost is None:
        print(f"\nrun {config.run_name}: stop requested; collecting what it did, then stopping", flush=True)
        return "stopped", None
    error = f"LeaseLost: {lease.lost}"
    print(f"\nrun {config.run_name} failed: {error}; stopping", flush=True)
    return "failed", error


async def _summarize_run(config: RunConfig, bucket, cluster, result: dict, status: str, error: str | None,
                         wall_time_s: float) -> dict:  # fmt: skip
    """What the run did, from the trainer's record and the cluster's actors (each asked, bounded), written
    to the bucket as summary.json (and curves.png), also when the run stopped or failed."""
    from rl_cluster.plots import curves_png
    from rl_cluster.pool_state import Restarts  # imported already (rl_cluster.pool): instant

    # After `ray job stop` the driver has seconds before Ray's SIGKILL (RAY_JOB_STOP_WAIT_TIME_S, 3 s by
    # default): summary.json is written first from the trainer's record and the proxy's stats, then again
    # with what the other actors add (restarts, scale events, the replicas' own reports).
    stats: dict = {}
    if cluster is not None:
        if status != "finished" and cluster.trainer is not None:
            # Stopped first: a checkpoint it published (and one retention deleted) after this report would
            # make summary.json's list wrong (CI saw it in the Ctrl-C'd chaos run).
            result = await _bounded(cluster.trainer.stop.remote(), result)
        stats = await _bounded(cluster.proxy.stats.remote(), {})
    summary = summarize(result, stats, wall_time_s, status=status, error=error,
                        placement=cluster.placement if cluster else {})  # fmt: skip
    _write_summary(bucket, config, summary, result)
    if cluster is None:
        return summary
    pool, trainer = cluster.pool, cluster.trainer
    restarts, reports, scale_events, actor_restarts, trainer_at = await asyncio.gather(
        _bounded(cluster.replica_restarts(), {}),
        _bounded(cluster.replica_reports(fresh=status == "finished"), {}),
        _bounded(pool.scale_events.remote(), []) if pool is not None else _now([]),
        _bounded(pool.restarts_so_far.remote(), None) if pool is not None else _now(Restarts(0, 0)),
        # Where the trainer is now: Ray may have restarted it on another node since the run began.
        _bounded(trainer.placement.remote(), None) if trainer is not None else _now(None),
    )
    if trainer_at:
        cluster.placement["trainer"] = trainer_at
    summary = summarize(
        result,
        stats,
        wall_time_s,
        status=status,
        error=error,
        placement=cluster.placement,
        replica_restarts=restarts,
        scale_events=scale_events,
        prefix_cache={rid: r["prefix_cache"] for rid, r in reports.items()},
        replica_versions={rid: r["versions_loaded"] for rid, r in reports.items()},
    )
    summary["trainer_restarts"] = result.get("trainer_restarts")  # the gang's restarts by Ray Train
    summary["trainer_ranks"] = result.get("ranks")  # where each rank runs (address, node_id, pid)
    summary["proxy_restarts"], summary["pool_restarts"] = astuple(actor_restarts or Restarts(None, None))
    # The pool controller's record (the syncs above fetched it): where each replica ran, what it came through.
    summary["placement_history"] = cluster.history.placement_history()
    # With the trainer's own restarts (only a restarted trainer knows when it trained again), by time.
    faults = cluster.history.fault_list() + result.get("faults", [])
    summary["faults"] = sorted(faults, key=lambda f: f["time"])
    _write_summary(bucket, config, summary, result)
    if cluster.trainer is not None:
        await _bounded(cluster.trainer.finish.remote(summary), None)
    if result["history"] and bucket is not None:
        curves = curves_png(result["history"], config.run_name, evals=result.get("evals"))
        bucket.write_bytes(config.run_name, "curves.png", curves)
    return summary


def _write_summary(bucket, config: RunConfig, summary: dict, result: dict) -> None:
    """summary.json, unless `bucket` is None (the lease was lost: the run is someone else's)."""
    summary["run_name"] = config.run_name
    summary["resumed_from_step"] = result.get("resumed_from_step")
    summary["experience"] = result.get("experience")
    if bucket is not None:
        bucket.write_text(config.run_name, "summary.json", json.dumps(summary, indent=2))


def _print_where(placement: dict, dashboard: str | None) -> None:
    """Where each actor runs, and where to watch the run: Ray's metrics exports and its dashboard."""
    for actor, where in placement.items():
        print(f"  {actor:<14} on {where['address']}", flush=True)
    print(f"Ray metrics (rl_trainer_*, rl_proxy_*, rl_generator_*): {metrics_exports()}", flush=True)
    if dashboard:
        print(f"Ray dashboard: {dashboard}", flush=True)


def metrics_exports() -> str:
    """Each live node's Ray metrics export, where Prometheus scrapes the run's metrics."""
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"] and n.get("MetricsExportPort")]
    return " ".join(f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in nodes)


def train_main(config: RunConfig, resume: bool = False) -> int:
    summary = asyncio.run(train(config, resume=resume))  # RunRefused: rl_cluster.cli makes it exit 2
    code = exit_status(summary)
    if code == 3:
        checks = summary["served_check"]
        print(
            f"FAILED: {checks['mismatch']} of {checks['checks']} served-vs-trained checks found a replica that "
            "does not serve the adapter the trainer trained (the banners above say which, and what it serves)"
            if checks["checks"]
            else "FAILED: no served-vs-trained check answered: nothing says the replicas serve what was trained",
            flush=True,
        )
    return code
