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


def parent_of_orphan(watch: bool, out, served: bool = False) -> None:
    """A trainer's stand-in: starts a daemon child as TRL's worker does (`served`: from rank 0's fork server,
    item 23), reports its pid and whether it is a fork of that server, waits."""
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    if served:
        from rl_cluster.trainer.rollout_server import rollout_context, start_rollout_server

        start_rollout_server()
        ctx = rollout_context()
    ready = mp.get_context("spawn").Queue()  # from TRL's context, as its worker's queues are
    child = ctx.Process(target=orphan, args=(watch, ready), daemon=True)
    child.start()
    ready.get(timeout=120)
    out.put((child.pid, preloaded_parent(child.pid)))
    time.sleep(120)


def preloaded_parent(pid: int) -> bool:
    """Whether process `pid`'s parent is a fork server that preloaded the rollout loop (not its starter)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        parent = int(f.read().rsplit(") ", 1)[1].split()[1])
    # python -c 'from multiprocessing.forkserver import main; main(.., [preloaded modules], ..)'
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        command = f.read()
    served = b"forkserver import main" in command and b"'rl_cluster.trainer.rollout'" in command
    return parent != os.getpid() and served


def cpu_ranks(rank: int, rendezvous: str, groups: int, step: int, budget: int, out) -> None:
    """One of two accelerate ranks over gloo with TRL's dataloader settings, for the tests that read their
    results (spawned once for all: each spawn imports torch, accelerate and TRL): what `without_lookahead`
    handed each rank (`pulled_rows`), a sync that rank 0's write fence refuses (`fenced_sync`), and a
    token-budget step (`packed_training`)."""
    import os

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    settings = DataLoaderConfiguration(dispatch_batches=True, split_batches=True)  # TRL's (AsyncGRPOConfig)
    accelerator = Accelerator(cpu=True, dataloader_config=settings)
    results = (
        pulled_rows(rank, accelerator),
        fenced_sync(rank, accelerator),
        packed_training(rank, accelerator, groups, step, budget),
    )
    out.put((rank, *results))
    # Sent before any teardown: 1 run in about 10, rank 0 stopped for good as its function returned, its
    # queue's feeder thread blocked before it had written the result (faulthandler's dump; a teardown that
    # holds the GIL, I think), and the parent waited in vain. The parent kills a child that does not end.
    out.close()
    out.join_thread()
    torch.distributed.destroy_process_group()


def pulled_rows(rank: int, accelerator) -> list:
    """Rank 0's loader yields 3 batches of two rows (rank 1's is empty, as TRL builds it), iterated through
    `without_lookahead`: the rows each rank got, and with each how many batches rank 0's loader had pulled
    by then."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from rl_cluster.trainer import compat

    pulled = []

    class Batches(IterableDataset):
        def __iter__(self):
            for k in range(1, 4) if rank == 0 else ():
                pulled.append(k)
                yield {"x": torch.tensor([[k], [10 * k]])}

    prepared = accelerator.prepare(DataLoader(Batches(), batch_size=1, collate_fn=lambda items: items[0]))
    return [(batch["x"].tolist(), len(pulled)) for batch in compat.without_lookahead(prepared, accelerator)]


def fenced_sync(rank: int, accelerator) -> tuple:
    """BucketSyncTrainer.sync_adapter on two ranks whose rank 0's write fence refuses the publication (its
    driver lost the lease): what each rank's sync returned to, and whether each rank's step-end callback
    stops training. Nothing of the trainer but what the decision reads exists: a rank that went on to save
    would fail on the missing model."""
    import threading
    from types import SimpleNamespace

    from transformers import TrainerControl

    from rl_cluster.core.fence import WriteFence
    from rl_cluster.trainer.callbacks import StopWhenAsked
    from rl_cluster.trainer.grpo import BucketSyncTrainer

    stop = threading.Event()  # the rank's stop, as Rank._fenced sets it
    fence = WriteFence(margin_s=15, first_news_s=0, on_refused=lambda why: stop.set())
    if rank == 0:
        fence.lost("lease.json is now held by host b")
    else:
        fence.renewed(60)
    trainer = SimpleNamespace(model_version=4, first_version=1, adapter_prefix="run", accelerator=accelerator,
                              fence=fence)  # fmt: skip
    BucketSyncTrainer.sync_adapter(trainer, 0.0)
    control = TrainerControl()
    StopWhenAsked(stop, accelerator).on_step_end(None, None, control)
    return trainer.model_version, stop.is_set(), control.should_training_stop


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


def packed_training(rank: int, accelerator, groups: int, step: int, budget: int) -> tuple[list, float]:
    """`packed_steps` over TRL's token-budget loader of `rollout_samples(groups)` on rank 0 (over nothing on
    rank 1, as TRL builds them), training each micro-batch with TRL's normalisation on a one-weight DDP
    model whose loss sums the row's trained tokens' advantages + 2 (a group's advantages sum to 0: without
    the shift any normalisation would give a gradient of 0). Per step the micro-batches it ran (its rows'
    group ids and trained-token counts) and, after the last, the weight's accumulated gradient."""
    from types import SimpleNamespace

    import torch
    from torch.utils.data import DataLoader
    from trl.experimental.async_grpo import async_grpo_trainer

    from rl_cluster.trainer import batching

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
    return steps, model.module.weight.grad.item()


def spawned_ranks(target, tmp_path, *args, timeout_s: float = 120) -> dict:
    """Run `target(rank, rendezvous, *args, out)` on two spawned processes; each puts
    `(rank, *result)` on `out`. Returns rank -> result (a tuple); a child that does not end is killed."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    ranks = [ctx.Process(target=target, args=(r, rendezvous, *args, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        return {rank: result for rank, *result in (out.get(timeout=timeout_s) for _ in ranks)}
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()


def rank_shards(rank: int, rendezvous: str, model_dir: str, out) -> None:
    """One of two accelerate ranks over gloo, given an FSDP2 plugin on CPU: first as accelerate 1.16 makes
    it (DDP), then with compat item 22. With the sharded model, the served-vs-trained check's forwards
    (both ranks in lockstep) against the same model unsharded, and against the model loaded in float64.
    Then the LoRA after 3 steps on one batch: the DDP and the FSDP2 model each on its half, and the
    unsharded model on all of it (one rank's training)."""
    import os

    import torch
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rl_cluster.trainer import check, compat
    from rl_cluster.trainer.callbacks import held_share

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)

    def lora_model(dtype=torch.float32):
        torch.manual_seed(0)  # the same LoRA weights each time; B != 0, so the adapter shows
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        return get_peft_model(base, LoraConfig(r=1, target_modules="all-linear", init_lora_weights=False))

    def fsdp2():
        return FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="FULL_STATE_DICT", auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Qwen2DecoderLayer"],
        )  # fmt: skip

    def trained(model, rows) -> dict:
        """The model's LoRA (by value: torch would share its memory) after 3 AdamW steps on `rows`."""
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):
            model(input_ids=rows, labels=rows).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return {n: t.numpy() for n, t in check.lora_state(getattr(model, "module", model)).items()}

    batch = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(7))
    share = batch.chunk(2)[rank]  # sequences of one length: the mean of the ranks' means is the batch's
    accelerator = Accelerator(cpu=True, fsdp_plugin=fsdp2())
    ddp = accelerator.prepare(lora_model())
    as_shipped = (accelerator.distributed_type.value, type(ddp).__name__)
    lora_after = {"DDP": trained(ddp, share)}
    AcceleratorState._reset_state()
    compat.shard_on_cpu()
    accelerator = Accelerator(cpu=True, fsdp_plugin=fsdp2())
    plain, sharded = lora_model(), accelerator.prepare(lora_model())
    held, whole = held_share(sharded)
    older = ("v1", {n: t / 2 for n, t in check.lora_state(plain).items()})
    prompt, samples = [1, 20, 30, 40], [{"token_ids": [50, 60, 70, 2]}, {"token_ids": [33, 44]}]
    computed = {  # as ServedCheck.run and .join compute them (both ranks at once for the sharded model)
        name: check.all_scores(model, [("replica", samples)], prompt, torch.float32, older)[0]
        for name, model in (("sharded", sharded), ("plain", plain))
    }
    in_float64 = check._logprobs_TOK(lora_model(torch.float64), prompt, samples)
    gathered = check.lora_state(sharded)
    same_lora = all(torch.equal(t, gathered[n]) for n, t in check.lora_state(plain).items())
    start = {n: t.numpy() for n, t in check.lora_state(plain).items()}
    lora_after.update({"FSDP2": trained(sharded, share), "one rank": trained(plain, batch)})
    out.put((rank, as_shipped, accelerator.distributed_type.value, held / whole, computed, in_float64, same_lora,
             start, lora_after))  # fmt: skip
    out.close()
    out.join_thread()  # sent before teardown (see cpu_ranks)
    torch.distributed.destroy_process_group()


def gloo_rank_that_dies(port: int) -> None:
    """Rank 1 of a two-rank gloo group whose rank 0 is the test: one all-reduce, then SIGKILLed, as the
    multi-node resume run kills a rank mid-run."""
    import datetime
    import os
    import signal

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60))
    group = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))
    group.allreduce([torch.ones(1)]).wait()
    os.kill(os.getpid(), signal.SIGKILL)
