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


def rank_pulls(rank: int, rendezvous: str, out) -> None:
    """One of two accelerate ranks over gloo, with TRL's dataloader settings, iterating `without_lookahead`:
    rank 0's loader yields 3 batches of two rows (rank 1's is empty, as TRL builds it); each rank reports
    the rows it got, and with each how many batches rank 0's loader had pulled by then."""
    import os

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader, IterableDataset

    from rl_cluster.trainer import compat

    pulled = []

    class Batches(IterableDataset):
        def __iter__(self):
            for k in range(1, 4) if rank == 0 else ():
                pulled.append(k)
                yield {"x": torch.tensor([[k], [10 * k]])}

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    settings = DataLoaderConfiguration(dispatch_batches=True, split_batches=True)  # TRL's (AsyncGRPOConfig)
    accelerator = Accelerator(cpu=True, dataloader_config=settings)
    prepared = accelerator.prepare(DataLoader(Batches(), batch_size=1, collate_fn=lambda items: items[0]))
    seen = [(batch["x"].tolist(), len(pulled)) for batch in compat.without_lookahead(prepared, accelerator)]
    out.put((rank, seen))
    torch.distributed.destroy_process_group()
