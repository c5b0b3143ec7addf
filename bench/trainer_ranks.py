"""Section 12: the trainer on 1 and 2 ranks, DDP against FSDP2, side by side.

A locally made random-weight Qwen2 model (about 1 GB in float32 in the full plan: the tiny model is too
small to show sharding) with the runs' rank-1 LoRA on every linear layer trains the same steps three
ways: one rank; two DDP ranks; two FSDP2 ranks (rl_cluster's compat item 22 makes accelerate shard on
CPU). Each rank is a spawned process pinned to its own core with one thread, over gloo; a step is
`rows` sequences of `tokens` tokens split over the ranks, forward, backward and an AdamW step, as the
trainer's micro-batch is. Measured per configuration: samples per second (median step), and on rank 0
the weights' bytes it holds, its resident memory after the steps and its peak. No Ray, no rollouts: the
trainer's own throughput, which the published system found to be the run's bottleneck.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

# label -> (ranks, strategy); run in this order, the order rotating between repetitions.
CONFIGS = {"1 rank": (1, "ddp"), "2 ranks, DDP": (2, "ddp"), "2 ranks, FSDP2": (2, "fsdp2")}


def model_shape(plan) -> dict:
    """The random model's Qwen2 config: ~1 GB of float32 weights in the full plan, ~2 MB in the quick one."""
    if plan.ranks_big_model:
        return {"hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 2816, "vocab_size": 32000,
                "num_attention_heads": 16, "num_key_value_heads": 16}  # fmt: skip
    return {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 1000,
            "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip


def rank_steps(rank: int, world: int, rendezvous: str, strategy: str, shape: dict, rows: int, tokens: int,
               steps: int, out) -> None:  # fmt: skip
    """One rank (a spawned process): build, prepare, train `steps` + 1 steps (the first a warm-up), report."""
    import ctypes
    import gc
    import os
    import resource

    import torch
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl_cluster.trainer import compat
    from rl_cluster.trainer.callbacks import held_share

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
        )
        torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    plugin = None
    if strategy == "fsdp2":
        compat.shard_on_cpu()
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="FULL_STATE_DICT", auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Qwen2DecoderLayer"],
        )  # fmt: skip
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False))
    model = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    held, whole = held_share(model)
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randint(3, shape["vocab_size"], (rows // world, tokens), generator=generator)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.wait_for_everyone()
        times.append(time.perf_counter() - start)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system: what the rank still needs
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.put((rank, {"held": held, "whole": whole, "step_s": statistics.median(times[1:]), "resident": resident,
                    "peak": peak, "distributed": accelerator.distributed_type.value}))  # fmt: skip
    out.close()
    out.join_thread()  # sent before teardown
    if world > 1:
        torch.distributed.destroy_process_group()


def measure(world: int, strategy: str, shape: dict, rows: int, tokens: int, steps: int, work) -> dict:
    """One configuration's ranks, spawned and waited for; rank 0's report."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rendezvous = f"file://{work / f'rendezvous-{time.monotonic_ns()}'}"
    args = (world, rendezvous, strategy, shape, rows, tokens, steps, out)
    ranks = [ctx.Process(target=rank_steps, args=(r, *args)) for r in range(world)]
    for p in ranks:
        p.start()
    try:
        reports = dict(out.get(timeout=1800) for _ in ranks)
    finally:
        for p in ranks:
            p.join(60)
            if p.is_alive():
                p.kill()
    return reports[0]


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    """Each configuration plan.ranks_reps times (the order rotating), medians per configuration."""
    import asyncio

    shape = model_shape(plan)
    rows, tokens, steps = (8, 64, 3) if plan.ranks_big_model else (4, 16, 1)
    log_dir.mkdir(parents=True, exist_ok=True)
    labels = list(CONFIGS)
    measured: dict[str, list[dict]] = {label: [] for label in labels}
    for rep in range(plan.ranks_reps):
        for label in labels[rep % len(labels) :] + labels[: rep % len(labels)]:
            world, strategy = CONFIGS[label]
            report = await asyncio.to_thread(measure, world, strategy, shape, rows, tokens, steps, log_dir)
            measured[label].append(report)
            print(f"  {label}: {rows / report['step_s']:.2f} samples/s, rank 0 holds "
                  f"{report['held'] / 2**20:.0f} of {report['whole'] / 2**20:.0f} MiB", flush=True)  # fmt: skip
    rows_out = []
    for label, reports in measured.items():
        rows_out.append({
            "config": label, "distributed": reports[0]["distributed"],
            "samples_per_s": statistics.median(rows / r["step_s"] for r in reports),
            "held": reports[0]["held"], "whole": reports[0]["whole"],
            "resident": statistics.median(r["resident"] for r in reports),
            "peak": statistics.median(r["peak"] for r in reports),
        })  # fmt: skip
    return {"shape": shape, "rows": rows, "tokens": tokens, "steps": steps, "rows_by_config": rows_out}


def section(r: dict) -> str:
    from bench.markdown import num, table

    def mib(x):
        return f"{x / 2**20:,.0f}"

    base = r["rows_by_config"][0]["samples_per_s"]
    rows = [
        [x["config"], x["distributed"], num(x["samples_per_s"]), num(x["samples_per_s"] / base) + "x",
         f"{mib(x['held'])} of {mib(x['whole'])}", mib(x["resident"]), mib(x["peak"])]
        for x in r["rows_by_config"]
    ]  # fmt: skip
    header = ["trainer", "accelerate's mode", "samples/s", "vs 1 rank", "rank 0 holds (MiB of weights)",
              "rank 0 resident after (MiB)", "rank 0 peak (MiB)"]  # fmt: skip
    s = r["shape"]
    return "\n\n".join([
        "## 12. Trainer ranks: 1 vs 2, DDP vs FSDP2",
        f"A random-weight Qwen2 ({s['num_hidden_layers']} layers, hidden {s['hidden_size']}, vocab "
        f"{s['vocab_size']}; {mib(r['rows_by_config'][0]['whole'])} MiB in float32) with rank-1 LoRA on every "
        f"linear layer; a step is {r['rows']} sequences of {r['tokens']} tokens split over the ranks (forward, "
        f"backward, AdamW), the median of {r['steps']} steps after a warm-up. Each rank is its own process on "
        "its own core (one thread), over gloo; no Ray and no rollouts (the trainer's own throughput).",
        table(header, rows),
        "What this shows: FSDP2 really shards (rank 0 holds half of the weights, where DDP holds all of them) "
        "and costs the gathers of every layer's weights in the forward and again in the backward, which on "
        "one core per rank over loopback gloo is a large share of the step. The peak is each rank's whole "
        "model built before it is sharded (on GPUs accelerate's `cpu_ram_efficient_loading` builds it on "
        "rank 0 only). What a GPU run changes: NCCL over NVLink moves a layer's weights in well under a "
        "millisecond and overlaps the next layer's gather with this layer's compute, so FSDP2's cost there is "
        "small, and its point is GPU memory (the base model's 1/N, not the LoRA's few MB of optimizer state); "
        "DDP stays the faster choice for a model that fits one GPU.",
    ])  # fmt: skip
