"""Where TRL's rollout child starts from (compat item 23): a fork server that has imported the child's loop
module, and with it torch, transformers and TRL, before training begins.

TRL spawns the child once training begins, after the first weight sync, and a spawned child imports the
whole stack afresh: ~15 s of one core on every trainer start and restart, with the rank waiting. Rank 0
starts this server as its training begins, so the imports run while it loads its model and publishes its
first version, and the child is a fork of the server: like a spawned child it inherits nothing of the
rank (no CUDA context, no threads), and it ends with the rank as before (rollout.exit_with_parent).
This module imports nothing heavy: a process that only starts the server does not pay for the stack.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

LOOP_MODULE = "rl_cluster.trainer.rollout"


def rollout_context():
    """The multiprocessing context TRL's worker starts the rollout child from."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([LOOP_MODULE])
    return ctx


def start_rollout_server() -> None:
    """Start the server now; it imports the stack in the background (a later start finds it running)."""
    rollout_context()
    multiprocessing.forkserver.ensure_running()
