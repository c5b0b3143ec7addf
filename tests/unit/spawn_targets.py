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
    out.close()
    out.join_thread()  # sent before teardown (see rank_trains_packed)
    torch.distributed.destroy_process_group()


def rollout_samples(groups: int, group_size: int = 4, prompt: int = 10, completion: int = 6):
    """Samples as TRL's RolloutQueueDataset yields them: a group's samples share their prompt."""
    import torch

    for g in range(groups):
        for s in range(group_size):
            ids = [1000 + g] * prompt + [100 * (s + 1) + t for t in range(completion)]
            yield {
                "input_ids": torch.tensor(ids),
                "completion_mask": torch.tensor([0] * prompt + [1] * completion),
                "old_log_probs": torch.full((prompt + completion,), -1.0),
                "advantage": float(s) - 1.5,
                "group_id": g,
                "metrics": {"reward": float(s)},
            }


def rank_trains_packed(rank: int, rendezvous: str, groups: int, step: int, budget: int, out) -> None:
    """One of two accelerate ranks over gloo iterating `packed_steps` (rank 0 over TRL's token-budget
    loader of `rollout_samples(groups)`, rank 1 over nothing, as TRL builds them), training each micro-batch with TRL's
    normalisation on a one-weight DDP model whose loss sums the row's trained tokens' advantages + 2 (a
    group's advantages sum to 0: without the shift any normalisation would give a gradient of 0).
    Reports per step the micro-batches it ran (its rows' group ids and trained-token counts) and, after
    the last, the weight's accumulated gradient."""
    import os
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader
    from trl.experimental.async_grpo import async_grpo_trainer

    from rl_cluster.trainer import batching

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    settings = DataLoaderConfiguration(dispatch_batches=True, split_batches=True)  # TRL's (AsyncGRPOConfig)
    accelerator = Accelerator(cpu=True, dataloader_config=settings)
    samples = list(rollout_samples(groups)) if rank == 0 else []
    planner = async_grpo_trainer.TokenBudgetBatcher(samples, 2, budget, {})
    collate = async_grpo_trainer.DataCollatorForRollout(pad_token_id=0, num_processes=2)
    loader = SimpleNamespace(base_dataloader=DataLoader(planner, batch_size=1, collate_fn=collate))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1, bias=False))
    torch.nn.init.zeros_(model.module.weight)
    steps = []
    for item in batching.packed_steps(loader, accelerator, step, budget):
        ran = []
        for batch in batching.step_rows(item):
            selected = batch["token_index"] >= 0
            loss = model(batch["advantages"][selected][:, None] + 2).sum()
            loss = loss / (batch["global_n_tokens"][0] / 2)  # TRL's: over the tokens per rank, DDP averages
            batching.over_step_tokens(loss, batch).backward()
            ran.append((sorted(set(batch["segment_id"][selected].tolist())), int(selected.sum())))
        steps.append(ran)
    out.put((rank, steps, model.module.weight.grad.item()))
    # Sent before any teardown: 1 run in about 10, rank 0 stopped for good as this function returned, its
    # queue's feeder thread blocked before it had written the result (faulthandler's dump; a teardown that
    # holds the GIL, I think), and the parent waited in vain. The parent kills a child that does not end.
    out.close()
    out.join_thread()
    torch.distributed.destroy_process_group()
