"""Replicas of one node claim cores of their own (rl_cluster.generator.cores): real flocks in a directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rl_cluster.generator.cores import claim_cores


def test_replicas_of_a_node_claim_distinct_cores_and_share_only_when_none_is_free(tmp_path):
    """Two TP-2 replicas of a 4-core node take 0|1 and 2|3 whatever their slots (the global slot put
    replicas 0 and 2 of one node on the same cores); a third shares, by its slot, and says so; a released
    claim's cores are the next replica's."""
    first = claim_cores(2, slot=0, available=[0, 1, 2, 3], lock_dir=tmp_path)
    second = claim_cores(2, slot=2, available=[0, 1, 2, 3], lock_dir=tmp_path)
    assert (first.cores, second.cores, first.shared, second.shared) == ((0, 1), (2, 3), (), ())
    third = claim_cores(2, slot=1, available=[0, 1, 2, 3], lock_dir=tmp_path)
    assert third.cores == third.shared == (2, 3) and "sharing [2, 3]" in third.describe()
    first.release()
    assert first.cores == ()  # it holds none now
    assert claim_cores(1, slot=5, available=[0, 1, 2, 3], lock_dir=tmp_path).cores == (0,)
    partly = claim_cores(2, slot=0, available=[0, 1, 2, 3], lock_dir=tmp_path)
    assert partly.cores == (1, 0) and partly.shared == (0,)  # one free core, one shared
    for claim in (second, third, partly):
        claim.release()


def test_a_killed_replicas_cores_are_free_again(tmp_path):
    """The kernel releases a flock with the last descriptor of its holder: an actor SIGKILLed (or lost
    with its node's processes) leaves no claim behind."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from rl_cluster.generator.cores import claim_cores as c; "
         f"from pathlib import Path; c(1, 0, [0, 1], Path({str(tmp_path)!r})); print('held', flush=True); "
         "time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        mine = claim_cores(1, slot=0, available=[0, 1], lock_dir=tmp_path)
        assert mine.cores == (1,) and not mine.shared  # core 0 is the other process's
        mine.release()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        deadline = time.monotonic() + 10
        while (claim := claim_cores(1, 0, [0, 1], tmp_path)).cores != (0,) and time.monotonic() < deadline:
            claim.release()
            time.sleep(0.1)
        assert claim.cores == (0,) and not claim.shared
        claim.release()
    finally:
        holder.kill()
        holder.wait()
