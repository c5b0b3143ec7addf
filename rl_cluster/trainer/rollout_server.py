"""Where TRL's rollout child starts from: a fork server that has imported the child's loop module, and with
it torch, transformers and TRL, before the child is asked for (why: compat item 23). The child ends with its
rank as a spawned one did (rollout.exit_with_parent). This module imports nothing heavy, so that starting
the server costs its caller nothing.
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
