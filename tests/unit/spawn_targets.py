"""Targets for processes the unit tests spawn, in a module that imports nothing heavy (a spawned child
imports the target's module before it runs)."""


def fill_and_exit(buffer, cancel: bool, returning) -> None:
    for i in range(64):
        buffer.put({"input_ids": list(range(1000)), "i": i})  # ~5 KB pickled each: more than a pipe holds
    if cancel:
        buffer.cancel_join_thread()
    returning.set()  # the target is done: what follows is the process's exit


def orphan(watch: bool, ready) -> None:
    """A rollout child's stand-in: with `watch`, it does what GroupPinnedRolloutLoop does at start."""
    import time

    if watch:
        from rl_cluster.trainer.rollout import exit_with_parent

        exit_with_parent()
    ready.put("ready")
    time.sleep(120)


def parent_of_orphan(watch: bool, out) -> None:
    """A trainer's stand-in: spawns a daemon child as TRL's worker does, reports its pid, waits."""
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    child = ctx.Process(target=orphan, args=(watch, ready), daemon=True)
    child.start()
    ready.get(timeout=120)
    out.put(child.pid)
    time.sleep(120)
