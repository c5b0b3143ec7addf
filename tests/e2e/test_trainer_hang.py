"""A trainer rank that hangs, end to end: its process is SIGSTOPped (what a paused VM or a frozen node does
to it) right after it committed a checkpoint. Nothing raises and nothing dies, so only a bound ends it: Ray
Train's health check of the rank goes unanswered for trainer.unresponsive_timeout_s, the gang is counted
dead and restarted, and the new rank resumes from the checkpoint while the generators and the proxy keep
serving. The run finishes every step, loses no group, and leaves neither the stopped process nor its
rollout child behind. (A killed rank and a lost trainer node are the multi-node runs'.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from conftest import alive, parent_pid, stop_run, the_runs_process, wait_for, wait_until_no_vllm_with

REPO = Path(__file__).resolve().parents[2]
RUN = "e2e-hang"
STEPS = 12
UNRESPONSIVE_S = 20


def children(pid: int) -> list[int]:
    return [
        int(stat.parent.name)
        for stat in Path("/proc").glob("[0-9]*/stat")
        if parent_pid(int(stat.parent.name)) == pid
    ]


def test_a_sigstopped_rank_is_counted_dead_after_its_bound_and_the_gang_resumes(tmp_path):
    name, value = "RL_CLUSTER_TEST", uuid.uuid4().hex
    marker, bucket, log = f"{name}={value}", tmp_path / "bucket", tmp_path / "run.log"
    command = [sys.executable, "jobs/train_grpo.py", "--config", "jobs/configs/cpu_demo.toml", f"run_name={RUN}",
               "cluster.address=local", f"bucket.uri={bucket}", f"trainer.max_steps={STEPS}",
               "trainer.checkpoint_every=4", f"trainer.unresponsive_timeout_s={UNRESPONSIVE_S}",
               "generator.replicas=1"]  # fmt: skip
    stopped, its_children = None, []
    with log.open("w") as out:
        run = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, name: value})  # fmt: skip
        try:
            (first,) = wait_for(log, r"trainer rank 0/1 on \S+ \(pid (\d+)\)", run, timeout_s=600)
            deadline = time.monotonic() + 900
            while not (bucket / RUN / "checkpoints" / "step-4" / "manifest.json").exists():
                assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-6000:]
                time.sleep(0.2)
            stopped = the_runs_process(marker, b"ray::RayTrainWorker", 60)
            assert stopped == int(first)  # the rank the coordinator announced
            its_children = children(stopped)
            assert its_children  # TRL's rollout worker, a spawned process of the rank
            os.kill(stopped, signal.SIGSTOP)
            # Ended by the bound, not by anything dying: Train's health check names the hang.
            wait_for(log, r"A worker health check has been hanging", run, timeout_s=UNRESPONSIVE_S + 120)
            (resumed,) = wait_for(log, r"trainer restarted by Ray: resuming from checkpoint step (\d+)", run,
                                  timeout_s=600)  # fmt: skip
            ranks = wait_for(log, r"trainer rank 0/1 on \S+ \(pid (\d+)\)", run, count=2, timeout_s=60)
            assert int(ranks[1]) != stopped
            assert run.wait(timeout=900) == 0, log.read_text()[-6000:]
        finally:
            if stopped is not None and alive(stopped):
                os.kill(stopped, signal.SIGCONT)  # never leave a stopped process of ours behind
            stop_run(run)
    assert not wait_until_no_vllm_with(marker), "a vLLM process outlived the run"
    assert not alive(stopped) and not [p for p in its_children if alive(p)], "the hung rank left a process"
    summary = json.loads((bucket / RUN / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["trainer_restarts"]) == ("finished", STEPS, 1), (
        summary
    )
    assert int(resumed) >= 4 and summary["resumed_from_step"] == int(resumed), summary
    assert summary["groups"]["failed"] == 0, summary["groups"]
    ((fault,),) = [[f for f in summary["faults"] if f["who"] == "trainer"]]
    assert fault["what"] == f"trainer restarted by Ray (from checkpoint step {resumed})", fault
    assert fault["recovered_s"] is not None, fault  # the restarted rank trained a step again
    assert [r["pid"] for r in summary["trainer_ranks"]] == [int(ranks[1])], summary["trainer_ranks"]
    # The record is the run's, across the restart: every step once, in order.
    steps = [json.loads(line)["step"] for line in (bucket / RUN / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), steps
    assert re.search(rf"step +{STEPS}/{STEPS}", log.read_text())
