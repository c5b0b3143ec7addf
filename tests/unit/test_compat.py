"""Each trainer workaround (rl_cluster/trainer/compat.py) is needed on this machine, and the replacement is
correct: TRL's own objects (its attention function, config, trainer and rollout loop) misbehave without
it and behave with it. No vLLM server is started; the trainer is built but never trained."""

import asyncio
import importlib.util
import multiprocessing as mp
import os
import signal
import tempfile
import time

import aiohttp
import pytest
import requests
import spawn_targets
import torch
import torch.nn.functional as F
from datasets import Dataset
from peft import LoraConfig
from trl.experimental.async_grpo import AsyncGRPOConfig, async_grpo_trainer, packing
from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, select_adapter_sync
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop
from trl.experimental.async_grpo.vllm_client import VLLMClient
from trl.trainer.utils import get_peak_flops_per_device as trl_peak_flops

from rl_cluster.config import ProxyConfig
from rl_cluster.core.admission import AdmissionWindow
from rl_cluster.core.rewards import arithmetic_reward
from rl_cluster.proxy.server import ProxyServer
from rl_cluster.tiny import make_prompts
from rl_cluster.trainer import batching, compat, rollout

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="shows what fails on a CPU-only machine")

# What /server_info reports for a server started as ServerSpec starts it (--enable-lora --max-loras 6
# --max-lora-rank 8, one data-parallel rank): TRL's own decision function then picks adapter-only sync.
LORA_SERVER_INFO = {
    "lora_config": {"max_lora_rank": 8, "max_loras": 6},
    "parallel_config": {"data_parallel_size": 1},
}


def reference_attention(q, k, v, lengths_q, lengths_k):
    """Per-segment attention with an explicit bottom-right causal mask, one segment at a time."""
    outs, oq, ok = [], 0, 0
    groups = q.shape[1] // k.shape[1]
    for lq, lk in zip(lengths_q, lengths_k, strict=True):
        qs = q[oq : oq + lq].permute(1, 0, 2)
        ks = k[ok : ok + lk].permute(1, 0, 2).repeat_interleave(groups, 0)
        vs = v[ok : ok + lk].permute(1, 0, 2).repeat_interleave(groups, 0)
        scores = qs @ ks.transpose(1, 2) / qs.shape[-1] ** 0.5
        allowed = torch.tensor([[t <= j + (lk - lq) for t in range(lk)] for j in range(lq)])
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append((F.softmax(scores, -1) @ vs).permute(1, 0, 2))
        oq, ok = oq + lq, ok + lk
    return torch.cat(outs)


def cu_seqlens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


@pytest.mark.parametrize("lengths_q,lengths_k", [([3, 5, 1], [3, 5, 1]), ([2, 4], [5, 4])])
def test_varlen_attention_matches_reference(lengths_q, lengths_k):
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    q = torch.randn(sum(lengths_q), heads, dim)
    k = torch.randn(sum(lengths_k), kv_heads, dim)
    v = torch.randn(sum(lengths_k), kv_heads, dim)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    out = compat.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    torch.testing.assert_close(out, reference_attention(q, k, v, lengths_q, lengths_k), atol=1e-5, rtol=1e-5)


def test_varlen_attention_is_differentiable():
    q = torch.randn(4, 2, 8, requires_grad=True)
    k = torch.randn(4, 1, 8, requires_grad=True)
    v = torch.randn(4, 1, 8, requires_grad=True)
    cu = torch.tensor([0, 1, 4])
    compat.varlen_attention(q, k, v, cu, cu, 3, 3).sum().backward()
    assert q.grad is not None and k.grad.abs().sum() > 0


def trl_tree_attention(lengths):
    """Call TRL's registered attention function (`packing.tree_attention`, what every attention layer of
    the trainer's model runs) on packed segments; returns (its output as T x H x D, the reference)."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    module = Qwen2Attention(
        Qwen2Config(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=kv_heads), 0
    )
    total = sum(lengths)
    q, k, v = (
        torch.randn(1, heads, total, dim),
        torch.randn(1, kv_heads, total, dim),
        torch.randn(1, kv_heads, total, dim),
    )
    out, _ = packing.tree_attention(
        module, q, k, v, None,
        tree_kv_index=torch.arange(total), tree_cu_seqlens_q=cu_seqlens(lengths),
        tree_cu_seqlens_k=cu_seqlens(lengths), tree_max_seqlen_q=max(lengths), tree_max_seqlen_k=max(lengths),
    )  # fmt: skip
    as_packed = [x.transpose(1, 2)[0] for x in (q, k, v)]
    return out[0], reference_attention(*as_packed, lengths, lengths)


@cpu_only
def test_trl_attention_needs_the_varlen_workaround(monkeypatch):
    """Unpatched, TRL's attention imports the hub-kernel loader `kernels` (not installed: it would fetch a
    CUDA flash-attention-3 build at run time). Patched, the same TRL function computes exact attention."""
    assert importlib.util.find_spec("kernels") is None, (
        "kernels is installed here: this test shows its absence"
    )
    original = getattr(packing, "_rl_cluster_original_flash_attn", packing._flash_attn)
    original.cache_clear()
    monkeypatch.setattr(packing, "_flash_attn", original)
    with pytest.raises(ModuleNotFoundError, match="No module named 'kernels'"):
        trl_tree_attention([3, 5])

    compat.apply_trainer_workarounds()
    assert packing._rl_cluster_original_flash_attn is original  # TRL's own function stays reachable
    out, reference = trl_tree_attention([3, 5, 1])
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


# Trainers are built, never trained: their output directories stay empty, and all go with this one.
_OUTPUT_ROOT = tempfile.TemporaryDirectory(prefix="rl_cluster-test-compat-")


def grpo_args(**overrides) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(dir=_OUTPUT_ROOT.name), report_to="none",
        per_device_train_batch_size=8, num_generations=4, max_steps=1,
        # Never contacted unless a test says where: the trainer is built, not trained.
        **{"vllm_server_base_url": "http://127.0.0.1:9", **overrides},
    )  # fmt: skip


class LoraSyncTrainer(AsyncGRPOTrainer):
    """TRL's trainer whose server probe (GET /server_info) is answered with what a server started with
    --enable-lora reports; the decision itself is TRL's."""

    def _init_lora_sync(self, model) -> bool:
        return select_adapter_sync(LORA_SERVER_INFO, model, self.args)


def build_trainer(model_dir, args: AsyncGRPOConfig) -> AsyncGRPOTrainer:
    return LoraSyncTrainer(
        model=str(model_dir), reward_funcs=[arithmetic_reward], args=args,
        train_dataset=Dataset.from_list(make_prompts(16, seed=0)),
        peft_config=LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", task_type="CAUSAL_LM"),
    )  # fmt: skip


def rollout_loop(trainer, cls: type = _AsyncRolloutLoop) -> _AsyncRolloutLoop:
    """The rollout loop exactly as TRL's worker process builds it from the worker's forwarded kwargs."""
    worker, ctx = trainer.rollout_worker, mp.get_context("spawn")
    loop = cls(
        **worker._loop_kwargs, rollout_buffer=worker.rollout_buffer,
        model_version_value=worker._model_version_value, heartbeat_value=worker._heartbeat_value,
        failed_event=worker._failed_event, exception_info_queue=worker._exception_info_queue,
        metrics_queue=ctx.Queue(),
    )  # fmt: skip
    loop._loop.close()
    loop._tool_pool.shutdown()
    return loop


@cpu_only
def test_trl_config_defaults_to_bf16_which_fails_on_cpu():
    with pytest.raises(ValueError, match="doesn't support bf16/gpu"):
        grpo_args()
    args = grpo_args(**compat.training_precision_kwargs())
    assert (args.bf16, args.fp16, args.use_cpu) == (False, False, True)


@cpu_only
def test_trl_trainer_cannot_be_built_on_cpu_without_the_mfu_workaround(tiny_model_dir, monkeypatch):
    args = grpo_args(**compat.training_precision_kwargs())
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", trl_peak_flops)  # unpatched
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        build_trainer(tiny_model_dir, args)

    compat.apply_trainer_workarounds()
    trainer = build_trainer(tiny_model_dir, args)
    assert trainer._peak_flops_per_device is None  # MFU off, as TRL does for an unknown device
    assert trainer._lora_sync  # what BucketSyncTrainer insists on


def test_workarounds_install_and_are_idempotent():
    compat.apply_trainer_workarounds()
    first = async_grpo_trainer.get_peak_flops_per_device
    compat.apply_trainer_workarounds()
    assert async_grpo_trainer.get_peak_flops_per_device is first  # not wrapped twice
    if not torch.cuda.is_available():
        assert packing._flash_attn().flash_attn_varlen_func is compat.varlen_attention
        assert packing._rl_cluster_original_flash_attn is not packing._flash_attn  # TRL's, not ours
        acc = type("Acc", (), {"device": torch.device("cpu")})()
        assert first(acc, "float32") is None


def test_trl_names_every_runs_adapters_alike_and_queues_16_groups(tiny_model_dir):
    """TRL 1.16 names every run's adapters `trl-policy-vN` (so two runs on the same servers collide, and
    share vLLM's name-keyed prefix cache) and lets 16 groups wait for scoring; the workarounds change the
    names the real rollout loop requests and the bound of its queue."""
    compat.apply_trainer_workarounds()
    run_a = build_trainer(tiny_model_dir, grpo_args(**compat.training_precision_kwargs()))
    run_b = build_trainer(tiny_model_dir, grpo_args(**compat.training_precision_kwargs()))
    loop_a, loop_b = rollout_loop(run_a), rollout_loop(run_b)
    assert run_a._lora_name == run_b._lora_name == "trl-policy"
    assert loop_a._request_model == loop_b._request_model == "trl-policy-v0"
    assert loop_a._groups_to_score.maxsize == 16

    compat.name_run_adapters(run_a, "run-a")
    compat.name_run_adapters(run_b, "run-b")
    compat.bound_score_queue(run_a, 2)
    run_a.rollout_worker.update_model_version(3)
    loop_a, loop_b = rollout_loop(run_a), rollout_loop(run_b)
    assert run_a._lora_name == "run-a"  # the trainer publishes <run>-vN (BucketSyncTrainer.sync_adapter)
    assert (loop_a._request_model, loop_b._request_model) == ("run-a-v3", "run-b-v0")
    assert loop_a._groups_to_score.maxsize == 2


def test_trl_tree_attention_cannot_run_a_plain_forward(tiny_model_dir):
    """The served-vs-trained check scores whole sequences without packing metadata (item 7)."""
    from transformers import AutoModelForCausalLM

    compat.apply_trainer_workarounds()
    model = build_trainer(tiny_model_dir, grpo_args(**compat.training_precision_kwargs())).model
    input_ids = torch.tensor([[3, 5, 7, 9, 11]])
    with pytest.raises(TypeError, match="tree_kv_index"), torch.no_grad():
        model(input_ids=input_ids)
    with compat.plain_attention(model), torch.no_grad():
        logits = model(input_ids=input_ids).logits
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    with torch.no_grad():  # the adapter is zero at init: the base model's logits
        torch.testing.assert_close(logits, reference(input_ids=input_ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="tree_kv_index"), torch.no_grad():
        model(input_ids=input_ids)  # back to TRL's attention afterwards


def test_trl_default_pipeline_outruns_the_staleness_window():
    """TRL's defaults queue 1024 samples and put max_staleness steps in flight beyond them (item 8)."""
    args = grpo_args(**compat.training_precision_kwargs())
    steps_ahead = (args.queue_maxsize + args.max_staleness * args.per_device_train_batch_size) / 8
    assert (args.queue_maxsize, args.max_inflight_tasks) == (1024, -1)  # -1: max_staleness steps' worth
    assert steps_ahead > args.max_staleness
    # With admission bounding what is started, the limits are sized to never bind before it: all the
    # samples admission lets out (3 steps' worth for max_staleness 2, a sync every step) plus one group
    # waiting at admission in its slots.
    window = AdmissionWindow(samples_per_step=32, sync_every=1, window=2)
    assert compat.pipeline_limits(window, num_generations=8) == {
        "queue_maxsize": 96,
        "max_inflight_tasks": 104,
    }


def test_trl_prints_every_log_dict_and_closes_with_a_totals_log(tiny_model_dir):
    from transformers import PrinterCallback

    compat.apply_trainer_workarounds()
    # disable_tqdm, as the trainer runs (TRL's progress bar does not reach Ray job logs): then the
    # transformers Trainer prints every log dict instead.
    trainer = build_trainer(
        tiny_model_dir, grpo_args(disable_tqdm=True, **compat.training_precision_kwargs())
    )
    printers = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PrinterCallback)]
    assert len(printers) == 1
    compat.quiet_default_printer(trainer)
    assert not [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PrinterCallback)]
    assert compat.is_step_log({"loss": 0.1, "reward": 0.5})
    assert not compat.is_step_log({"train_runtime": 12.0, "train_loss": 0.1})  # what train() logs last
    assert not compat.is_step_log({})


class _CountingBatches(torch.utils.data.IterableDataset):
    """An endless iterable of one-row batches that records how many were pulled (a rollout queue's view)."""

    def __init__(self):
        self.pulled = 0

    def __iter__(self):
        while True:
            self.pulled += 1
            yield {"x": torch.tensor([self.pulled])}


def _only(items):
    return items[0]  # TRL's planner yields whole micro-batches; the DataLoader takes them one at a time


def test_accelerate_pulls_the_next_batch_before_yielding_one():
    """Item 11: with TRL's accelerator settings (dispatch_batches), the prepared DataLoader has pulled
    batch k+1 when it hands out batch k; without_lookahead has pulled exactly the batches it yielded."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    settings = DataLoaderConfiguration(dispatch_batches=True, split_batches=True)  # TRL's (AsyncGRPOConfig)
    accelerator = Accelerator(cpu=True, dataloader_config=settings)
    source = _CountingBatches()
    prepared = accelerator.prepare(DataLoader(source, batch_size=1, collate_fn=_only))
    batches = iter(prepared)
    assert next(batches)["x"].tolist() == [1]
    assert source.pulled == 2  # the lockstep trainer would wait here for a step not yet generated

    source = _CountingBatches()
    prepared = accelerator.prepare(DataLoader(source, batch_size=1, collate_fn=_only))
    lazy = iter(compat.without_lookahead(prepared, accelerator))
    assert [next(lazy)["x"].tolist() for _ in range(3)] == [[1], [2], [3]]
    assert source.pulled == 3


@pytest.fixture(scope="module")
def two_cpu_ranks(tmp_path_factory) -> dict:
    """Two accelerate ranks over gloo, spawned once for the tests that read their results
    (spawn_targets.cpu_ranks): rank -> (rows each got, the fenced sync's outcome, the packed step's)."""
    groups = 3  # 12 samples: the packed step
    return spawn_targets.spawned_ranks(
        spawn_targets.cpu_ranks, tmp_path_factory.mktemp("ranks"), groups, 4 * groups, BUDGET
    )


def test_with_two_ranks_rank_0_pulls_each_batch_as_the_step_starts_and_each_rank_gets_its_row(two_cpu_ranks):
    """Item 11 with several ranks: rank 0 pulls a batch only when it is yielded, broadcasts it, and each
    rank trains its own row; the end of rank 0's data ends every rank's loop."""
    seen = {rank: ranks[0] for rank, ranks in two_cpu_ranks.items()}
    assert seen[0] == [([[1]], 1), ([[2]], 2), ([[3]], 3)]  # pulled: exactly the batches yielded
    assert [rows for rows, _ in seen[1]] == [[[10]], [[20]], [[30]]]


def test_a_publication_rank_0s_fence_refuses_is_skipped_by_every_rank_and_stops_both(two_cpu_ranks):
    """Rank 0's driver lost the lease: rank 0's fence refuses the version's publication. Every rank skips
    the whole sync (the save is a collective: rank 1 alone would wait in it), none moves its version, and at
    the step's end both stop (the stop is all-reduced), rather than rank 0 raising mid-step while rank 1
    waits in a collective until the gang is aborted."""
    assert two_cpu_ranks[0][1] == (4, True, True)  # rank 0: refused, its stop set
    assert two_cpu_ranks[1][1] == (4, False, True)  # rank 1: told by the all-reduce


def test_accelerate_drops_fsdp_on_cpu_and_the_check_computes_on_the_shards_in_lockstep(
    tiny_model_dir, tmp_path
):
    """Item 22: given an FSDP2 plugin on CPU, accelerate 1.16 keeps MULTI_CPU and wraps the model in DDP
    without a word; with the workaround the ranks are FSDP ranks and each holds half of the weights. The
    served-vs-trained check's forwards on the sharded model (both ranks at once) are those of the same
    model unsharded, and its "exact" ones those of the model loaded in float64. Two DDP and two FSDP2
    ranks, each on half of a batch, train the LoRA that one rank trains on all of it."""
    seen = spawn_targets.spawned_ranks(
        spawn_targets.rank_shards, tmp_path, str(tiny_model_dir), timeout_s=240
    )
    for rank in (0, 1):
        as_shipped, distributed, share, computed, in_float64, same_lora, start, trained = seen[rank]
        assert as_shipped == ("MULTI_CPU", "DistributedDataParallel")  # the plugin dropped
        assert distributed == "FSDP" and 0.45 < share < 0.55
        sharded, plain = computed["sharded"], computed["plain"]
        for mine, reference in ((sharded.trained, plain.trained), (sharded.rounded, plain.rounded),
                                (sharded.exact, in_float64), *zip(sharded.alternatives.values(),
                                                                  plain.alternatives.values(), strict=True)):  # fmt: skip
            assert mine == pytest.approx(reference, abs=1e-12)
        assert set(sharded.alternatives) == {"base", "v1"}
        assert max(abs(a - b) for a, b in zip(sharded.exact, sharded.trained, strict=True)) > 1e-10  # float64
        assert max(abs(a - b) for a, b in zip(sharded.alternatives["v1"], sharded.exact, strict=True)) > 1e-4
        assert same_lora  # the gathered LoRA (the older version's weights) is whole on every rank
        one = trained["one rank"]
        assert max(abs(one[n] - start[n]).max() for n in one) > 1e-3  # the steps moved the LoRA
        for ranks in ("DDP", "FSDP2"):
            assert max(abs(trained[ranks][n] - one[n]).max() for n in one) < 1e-4, ranks


def _read_position(position, out):
    out.put((position[rollout.TrainerPosition.LIMIT], position[rollout.TrainerPosition.PULLED]))
    position.add(rollout.TrainerPosition.SCORED, 5)
    first = position.proxy_url
    out.put(first)
    deadline = time.monotonic() + 30
    while position.proxy_url == first and time.monotonic() < deadline:  # until the parent moves it
        time.sleep(0.01)
    out.put(position.proxy_url)


def test_trls_pickle_check_refuses_shared_arrays_and_position_travels_to_a_spawned_child():
    """Item 12: TRL's worker pickles the loop kwargs before it spawns the child, to catch lambdas; a
    multiprocessing array cannot be pickled outside spawning, so TRL refuses to start. TrainerPosition
    passes the check and still reaches the spawned child as shared memory, both ways; the proxy's URL
    the trainer moves while the child runs reaches it too."""
    import pickle

    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    ctx = mp.get_context("spawn")
    worker = AsyncRolloutWorker(position=ctx.Array("q", 4, lock=False))
    with pytest.raises(TypeError, match="must be picklable"):
        worker.start()
    assert worker._process is None  # refused before spawning anything

    position = rollout.TrainerPosition(ctx, limit=96, proxy_url="http://10.0.0.1:8000")
    pickle.dumps({"position": position})  # TRL's check
    position.add(rollout.TrainerPosition.PULLED, 7)
    out = ctx.Queue()
    child = ctx.Process(target=_read_position, args=(position, out))
    child.start()
    try:
        assert out.get(timeout=60) == (96, 7)
        assert out.get(timeout=30) == "http://10.0.0.1:8000"
        position.follow_proxy("http://10.0.0.2:8000")
        assert out.get(timeout=30) == "http://10.0.0.2:8000"
        child.join(30)
        assert child.exitcode == 0
        assert position[rollout.TrainerPosition.SCORED] == 5
    finally:
        child.kill()
    with pytest.raises(ValueError, match="at most 511"):
        position.follow_proxy("http://" + "a" * 600)


@pytest.mark.parametrize("cancel", [False, True])
def test_a_child_with_an_unread_full_buffer_does_not_exit(cancel):
    """Item 13: what TRL's rollout child does when training ends (its buffer is a spawn-context Queue)."""
    ctx = mp.get_context("spawn")
    buffer, returning = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=spawn_targets.fill_and_exit, args=(buffer, cancel, returning))
    child.start()
    assert returning.wait(60)  # (the child's start is a spawn: imports, slow on a loaded machine)
    child.join(5)  # an exit takes milliseconds; a blocked feeder thread waits for ever
    try:
        assert child.is_alive() is not cancel
    finally:
        child.kill()
        child.join()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"  # a zombie has exited


@pytest.mark.parametrize(("watch", "served"), [(False, False), (True, True)])
def test_a_daemon_child_outlives_a_killed_parent_unless_it_watches(watch, served):
    """Item 14: TRL's rollout child is a daemon process of the trainer; SIGKILL the trainer and it stays
    (spawned, as TRL starts it). Ours watches, and ends with the trainer: forked from rank 0's fork server
    (item 23), as the trainer starts it."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    parent = ctx.Process(target=spawn_targets.parent_of_orphan, args=(watch, out, served))
    parent.start()
    try:
        child_pid, forked = out.get(timeout=120)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.join()
    try:
        assert forked is served  # a fork of the server, not a child its starter spawned
        deadline = time.monotonic() + (10 if watch else 3)  # watching, it exits well within a second
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(child_pid) is not watch
    finally:
        if _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_trl_spawns_its_rollout_child_and_ours_starts_from_a_fork_server_of_the_training_stack():
    """Item 23: TRL's worker spawns the child (it imports the training stack afresh, after the first sync);
    ours forks it from a server that preloads the loop's module, and with it torch, transformers and TRL.
    That a forked child works, and ends with its trainer: the item 14 test, served."""
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    worker = AsyncRolloutWorker()
    assert worker._mp_ctx.get_start_method() == "spawn"
    trainer = type("Trainer", (), {"rollout_worker": worker})()
    rollout.pin_group_versions(trainer, window=2)
    assert worker._mp_ctx.get_start_method() == "forkserver"
    assert mp.forkserver._forkserver._preload_modules == [rollout.__name__]


_rollout_samples = spawn_targets.rollout_samples


class _Pulls:
    """A finite sample source that counts what was pulled from it."""

    def __init__(self, samples):
        self.samples, self.pulled = list(samples), 0

    def __iter__(self):
        for sample in self.samples:
            self.pulled += 1
            yield sample


STEP, BUDGET = 8, 64  # a group of 4 costs 10 + 4 * 6 + 3 = 37 unique tokens (24 trained): 1 group per row


def test_trl_token_budget_batcher_ignores_the_step_size_and_pulls_ahead():
    """Item 16: given exactly one step's samples, TRL's batcher yields no step at all (it closes a
    micro-batch only on a sample that does not fit); with more it yields micro-batches of whatever fills
    the budget, each after pulling one sample past it. Admission lets only the step's samples be
    generated, so the trainer waits for ever."""
    metrics = {"batch/dropped_oversize_total": []}
    source = _Pulls(_rollout_samples(groups=STEP // 4))
    assert list(async_grpo_trainer.TokenBudgetBatcher(source, 1, 10_000, metrics)) == []
    assert source.pulled == STEP  # the step's samples, all pulled, and no step to train

    source = _Pulls(_rollout_samples(groups=4 * STEP // 4))
    (row,) = next(iter(async_grpo_trainer.TokenBudgetBatcher(source, 1, BUDGET, metrics)))
    assert len(row.samples) == 6 and source.pulled == 7  # not a step's 8; one pulled past the micro-batch
    source = _Pulls(_rollout_samples(groups=4 * STEP // 4))
    (row,) = next(iter(async_grpo_trainer.TokenBudgetBatcher(source, 1, 200, metrics)))
    assert len(row.samples) == 20 and source.pulled == 21


def test_step_packer_yields_each_step_exactly_within_the_budget():
    """Item 16: each item is one step of exactly `samples_per_step` samples, pulled without look-ahead,
    in rows of at most `token_budget` unique and trained tokens, a group's samples together."""
    source = _Pulls(_rollout_samples(groups=3 * STEP // 4))
    steps = iter(batching.StepPacker(source, STEP, BUDGET))
    for k in range(1, 4):
        rows = [row for (row,) in next(steps)]  # one rank: micro-batches of one row
        assert source.pulled == k * STEP
        assert sum(len(row.samples) for row in rows) == STEP
        assert len(rows) == 2 and all(len(row.groups) == 1 for row in rows)
        assert all(len(row.tokens) <= BUDGET and row.trained <= BUDGET for row in rows)
    # A budget that holds the whole step packs it into one row: prompts shared, no copy of a sample.
    (row,) = batching.pack_rows(list(_rollout_samples(groups=2)), token_budget=10_000)
    assert len(row.samples) == STEP and len(row.tokens) == 2 * (10 + 4 * 6 + 3)  # + a token per fork
    with pytest.raises(ValueError, match="exceeds trainer.token_budget=12"):
        batching.pack_rows(list(_rollout_samples(groups=1)), token_budget=12)


def test_packed_step_rows_go_through_trls_collator_with_the_steps_token_count():
    """The rows of a step become micro-batches of TRL's own collator, each told the step's trained
    tokens (48 = 8 samples x 6) beside its own (24)."""
    collate = async_grpo_trainer.DataCollatorForRollout(pad_token_id=0)
    step = batching.collate_step(next(iter(batching.StepPacker(_rollout_samples(2), STEP, BUDGET))), collate)
    micro_batches = step[batching.MICRO_BATCHES]
    assert [float(b["global_n_tokens"][0]) for b in micro_batches] == [24.0, 24.0]
    assert [float(b[batching.STEP_TOKENS][0]) for b in micro_batches] == [48.0, 48.0]
    assert collate.groups_trained == {0, 1}


def test_a_step_for_several_ranks_gives_each_rank_as_many_rows():
    """With N ranks a step's rows are split until every rank has as many (each backward all-reduces), a
    group's samples stay together where they can, and no sample is lost or doubled."""
    samples = list(_rollout_samples(groups=3))  # 12 samples: 3 rows of one group each at BUDGET
    batches = batching.micro_batches(batching.pack_rows(samples, BUDGET), 2)
    assert len(batches) == 2 and all(len(rows) == 2 for rows in batches)
    placed = [id(s) for rows in batches for row in rows for s in row.samples]
    assert sorted(placed) == sorted(id(s) for s in samples)
    assert sum(len(row.groups) for rows in batches for row in rows) == 4  # one group was cut in two
    shares = [sum(rows[r].load for rows in batches) for r in (0, 1)]
    assert max(shares) <= 1.5 * min(shares)  # balanced by attention cost
    # One row of a whole step, 4 ranks: split down to a sample per rank.
    (row,) = batching.pack_rows(samples[:4], 10_000)
    assert [[len(r.samples) for r in rows] for rows in batching.micro_batches([row], 4)] == [[1, 1, 1, 1]]
    with pytest.raises(ValueError, match="3 single-sample rows cannot be shared by 2 ranks"):
        batching.micro_batches(batching.pack_rows(samples[:3], 16), 2)


def test_two_ranks_train_a_packed_step_as_one_token_mean(two_cpu_ranks):
    """Two ranks over gloo: rank 0 packs each step (the others get only their rows), both run as many
    micro-batches, and DDP's averaged gradient is the step's token mean over all samples, as one rank's."""
    samples = list(_rollout_samples(3))  # the same ones rank 0 makes
    (steps0, grad0), (steps1, grad1) = two_cpu_ranks[0][2], two_cpu_ranks[1][2]
    assert len(steps0) == len(steps1) == 1 and len(steps0[0]) == len(steps1[0]) == 2  # 4 rows, 2 each
    tokens = sum(int(s["completion_mask"].sum()) for s in samples)
    assert sum(n for _, n in steps0[0] + steps1[0]) == tokens  # every trained token, once
    trained = sum(
        (s["advantage"] + 2) * int(s["completion_mask"].sum()) for s in samples
    )  # as the ranks' loss
    assert grad0 == grad1 == pytest.approx(trained / tokens)


class _TokenMeanTrainer:
    """TRL's loss normalisation (compute_loss): a micro-batch's summed token losses over its own trained
    tokens, backward in training_step."""

    def __init__(self):
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)
        self.weight = torch.zeros((), requires_grad=True)
        self.micro_batches = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return (inputs["x"] * self.weight).sum() / inputs["global_n_tokens"][0]

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.micro_batches += 1
        # As BucketSyncTrainer.compute_loss returns TRL's loss, normalised over the step's tokens.
        loss = batching.over_step_tokens(self.compute_loss(model, inputs), inputs)
        loss.backward()
        return loss.detach()


def test_a_packed_step_trains_its_rows_as_one_token_mean():
    """The rows of one step are accumulated into one gradient, the step's token mean (as if all of its
    samples were one micro-batch), whatever the rows' sizes."""
    tokens = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])]
    micro_batches = [
        {"x": x, "global_n_tokens": torch.tensor([float(len(x))]), batching.STEP_TOKENS: torch.tensor([4.0])}
        for x in tokens
    ]
    trainer = _TokenMeanTrainer()
    rows = batching.step_rows({batching.MICRO_BATCHES: micro_batches})
    loss = batching.train_rows(trainer.training_step, torch.nn.Linear(1, 1), rows)
    assert batching.step_rows(micro_batches[0]) is None  # TRL's own items are not packed steps
    assert trainer.micro_batches == 2
    assert trainer.weight.grad.item() == pytest.approx(16.0 / 4) and loss.item() == pytest.approx(0.0)


class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def forward(self, x, labels=None):
        return {"loss": ((self.w(x).squeeze(-1) - labels) ** 2).mean()}


class _Endless(torch.utils.data.IterableDataset):
    """No length, as AsyncGRPOTrainer's rollout queue: transformers sizes an 'epoch' as max_steps updates."""

    def __iter__(self):
        while True:
            yield {"x": torch.ones(2), "labels": torch.tensor(1.0)}


def _steps_trainer(output_dir, max_steps: int):
    from transformers import Trainer, TrainingArguments

    # ignore_data_skip: AsyncGRPOTrainer forces it on.
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, save_steps=2, per_device_train_batch_size=2,
        ignore_data_skip=True, report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=1,
    )  # fmt: skip
    trainer = Trainer(model=_Regression(), args=args, train_dataset=_Endless())
    trainer.remove_callback(__import__("transformers").PrinterCallback)
    return trainer


def test_a_trainer_resumed_at_max_steps_trains_one_step_more_unless_guarded(tmp_path):
    """Item 17, deterministically: the off-by-one of a resumed run that recorded step 29 of 28."""
    first = _steps_trainer(tmp_path, max_steps=4)
    first.train()
    assert first.state.global_step == 4 and (tmp_path / "checkpoint-4").is_dir()
    unguarded = _steps_trainer(tmp_path / "again", max_steps=4)
    unguarded.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert unguarded.state.global_step == 5  # transformers' own resume: one step past max_steps

    guarded = _steps_trainer(tmp_path / "guarded", max_steps=4)
    assert compat.train_to_max_steps(guarded, str(tmp_path / "checkpoint-4")) is None
    assert guarded.state.global_step == 0  # train() never ran: no step past the checkpoint
    # From an earlier checkpoint it trains, to max_steps exactly.
    earlier = _steps_trainer(tmp_path / "earlier", max_steps=4)
    compat.train_to_max_steps(earlier, str(tmp_path / "checkpoint-2"))
    assert earlier.state.global_step == 4
    shorter = _steps_trainer(tmp_path / "shorter", max_steps=3)
    with pytest.raises(ValueError, match="step 4, past max_steps=3: resume with trainer.max_steps above 4"):
        compat.train_to_max_steps(shorter, str(tmp_path / "checkpoint-4"))


class _SyncProbe(compat.AdapterSyncTrainer, LoraSyncTrainer):
    def sync_adapter(self, t0):
        self.synced_at = t0
        return t0, t0, t0


@cpu_only
def test_trls_adapter_sync_is_private_and_adapter_sync_trainer_routes_and_names_it(tiny_model_dir):
    """Item 18 on the real trainer: TRL's own sync step calls `sync_adapter`, and the private state a
    replacement needs is where the public names say."""
    compat.apply_trainer_workarounds()
    args = grpo_args(**compat.training_precision_kwargs())
    trainer = _SyncProbe(
        model=str(tiny_model_dir), reward_funcs=[arithmetic_reward], args=args,
        train_dataset=Dataset.from_list(make_prompts(16, seed=0)),
        peft_config=LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", task_type="CAUSAL_LM"),
    )  # fmt: skip
    assert trainer.syncs_adapters is trainer._lora_sync is True
    assert trainer.adapter_prefix == trainer._lora_name == "trl-policy"
    assert trainer.peft_adapter == trainer._adapter_name == "default"
    assert trainer.trained_group_ids is trainer._trained_groups
    assert trainer.rollout_context is trainer.rollout_worker._mp_ctx
    assert compat.train_metrics(trainer) is trainer._metrics["train"]
    trainer._sync_weight()  # TRL's step that runs at train begin and after each weight_sync_steps
    assert trainer.synced_at > 0
    with pytest.raises(NotImplementedError):
        compat.AdapterSyncTrainer.sync_adapter(trainer, 0.0)


async def test_trls_clients_send_no_token_and_the_authorized_ones_do(tiny_model_dir):
    """Item 19 against the real proxy holding a token, with no replica behind it: TRL's client probe and
    its rollout loop's generation post get 401; ours get past the token (then 503: no replica)."""
    proxy = ProxyServer(ProxyConfig(auth_token="s3cret", unavailable_timeout_s=0.2))
    url = await proxy.start()
    try:
        # requests blocks: in a thread, or it would block the loop the proxy serves on.
        with pytest.raises(requests.HTTPError, match="401"):
            await asyncio.to_thread(VLLMClient(url).get_server_info)
        with pytest.raises(requests.HTTPError, match="503"):
            await asyncio.to_thread(compat.AuthorizedVLLMClient(url, auth_token="s3cret").get_server_info)

        compat.apply_trainer_workarounds()
        trainer = _SyncProbe(
            model=str(tiny_model_dir), reward_funcs=[arithmetic_reward],
            args=grpo_args(vllm_server_base_url=url, **compat.training_precision_kwargs()),
            train_dataset=Dataset.from_list(make_prompts(16, seed=0)), proxy_token="s3cret",
            peft_config=LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", task_type="CAUSAL_LM"),
        )  # fmt: skip
        # The client TRL made and assigned in its __init__ is the authorized one, at TRL's URL.
        assert isinstance(trainer.vllm_client, compat.AuthorizedVLLMClient)
        assert trainer.vllm_client.server_url == url
        plain = rollout_loop(trainer)
        rollout.pin_group_versions(trainer, window=2, auth_token="s3cret")
        pinned = rollout_loop(trainer, rollout.GroupPinnedRolloutLoop)
        body = {"model": str(tiny_model_dir), "prompt": [1, 20], "max_tokens": 1}
        async with aiohttp.ClientSession() as session:
            for loop, status in ((plain, 401), (pinned, 503)):
                loop.session = session
                with pytest.raises(aiohttp.ClientResponseError) as answer:
                    await loop._post("/v1/completions", body, timeout=30, max_retries=1)
                assert answer.value.status == status
    finally:
        await proxy.stop()


@cpu_only
def test_trl_adds_two_interval_callbacks_and_transformers_warns_unless_added_quietly(tiny_model_dir):
    """Item 20: TRL's trainer alone makes transformers warn of a second StepIntervalCallback (with the
    whole callback list); AdapterSyncTrainer adds the same two callbacks without a word."""
    import logging

    from trl.experimental.async_grpo.async_grpo_trainer import StepIntervalCallback

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.trainer_callback")
    logger.addHandler(handler)
    compat.apply_trainer_workarounds()
    kwargs = dict(model=str(tiny_model_dir), reward_funcs=[arithmetic_reward],
                  train_dataset=Dataset.from_list(make_prompts(16, seed=0)),
                  peft_config=LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", task_type="CAUSAL_LM"))  # fmt: skip
    try:
        build_trainer(tiny_model_dir, grpo_args(**compat.training_precision_kwargs()))
        warned = [r.getMessage() for r in records if "StepIntervalCallback" in r.getMessage()]
        assert warned and "there is already one" in warned[0]
        records.clear()
        ours = _SyncProbe(args=grpo_args(**compat.training_precision_kwargs()), **kwargs)
        assert not [r for r in records if "already one" in r.getMessage()]
    finally:
        logger.removeHandler(handler)
    intervals = [c for c in ours.callback_handler.callbacks if isinstance(c, StepIntervalCallback)]
    assert len(intervals) == 2  # both still run: the sync and the step metrics


def test_trls_async_loss_has_no_correction_and_a_captured_forward_gives_one_over_trls_own(tiny_model_dir):
    """Item 21: AsyncGRPOConfig has no importance-sampling correction (TRL's synchronous GRPOConfig has
    `vllm_importance_sampling_correction`); our loss over the forward TRL's compute_loss made is TRL's
    under `none`, and under `tis` gets TRL's gradient on-policy and another one off it."""
    from trl import GRPOConfig

    from rl_cluster.trainer.correction import OffPolicyCorrection

    assert "vllm_importance_sampling_correction" in GRPOConfig.__dataclass_fields__
    assert not [f for f in AsyncGRPOConfig.__dataclass_fields__ if "importance" in f or "correction" in f]

    compat.apply_trainer_workarounds()
    trainer = LoraSyncTrainer(
        model=str(tiny_model_dir), reward_funcs=[arithmetic_reward], args=grpo_args(**compat.training_precision_kwargs()),
        train_dataset=Dataset.from_list(make_prompts(16, seed=0)),
        peft_config=LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", task_type="CAUSAL_LM"),
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # set by transformers' training loop, not run here
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)  # an adapter that changes outputs: gradients reach lora_A too
    samples = [
        {**s, "input_ids": s["input_ids"] % 40 + 3, "advantage": s["advantage"]} for s in _rollout_samples(2)
    ]
    collate = async_grpo_trainer.DataCollatorForRollout(pad_token_id=0)
    inputs = batching.collate_step(next(iter(batching.StepPacker(samples, STEP, BUDGET))), collate)
    inputs = inputs[batching.MICRO_BATCHES][0]  # one group: TRL's collated micro-batch, as trained
    model, selected = trainer.model, inputs["token_index"] >= 0

    def loss_and_grads(compute):
        model.zero_grad()
        loss = compute()
        loss.backward()
        return loss.detach(), [p.grad.clone() for n, p in model.named_parameters() if p.requires_grad]

    def corrected(method: str):
        """BucketSyncTrainer.compute_loss: TRL's over a captured forward, then the correction."""
        forward = compat.captured_forward(model)
        loss = AsyncGRPOTrainer.compute_loss(trainer, forward, inputs)
        return OffPolicyCorrection(method).loss(trainer, forward.outputs, inputs, loss)

    trl_loss, trl_grads = loss_and_grads(lambda: AsyncGRPOTrainer.compute_loss(trainer, model, inputs))
    none_loss, none_grads = loss_and_grads(lambda: corrected("none"))
    assert none_loss == trl_loss and all(
        torch.equal(a, b) for a, b in zip(none_grads, trl_grads, strict=True)
    )
    assert (
        trainer._metrics["train"]["correction/ratio_max"]
        and trainer._metrics["train"]["correction/ratio_mean"]
    )

    forward = compat.captured_forward(model)
    AsyncGRPOTrainer.compute_loss(trainer, forward, inputs)
    logp = forward.outputs.log_probs.flatten()[inputs["token_index"][selected]].detach()
    inputs["old_log_probs"][selected] = logp  # on-policy: every ratio 1
    _, trl_grads = loss_and_grads(lambda: AsyncGRPOTrainer.compute_loss(trainer, model, inputs))
    _, tis_grads = loss_and_grads(lambda: corrected("tis"))
    for a, b in zip(tis_grads, trl_grads, strict=True):
        torch.testing.assert_close(a, b)
    inputs["old_log_probs"][selected] = logp - 1.5  # pi_train / pi_vllm = e^1.5: TRL clips, TIS caps at 2
    _, trl_grads = loss_and_grads(lambda: AsyncGRPOTrainer.compute_loss(trainer, model, inputs))
    _, tis_grads = loss_and_grads(lambda: corrected("tis"))
    assert any(not torch.allclose(a, b) for a, b in zip(tis_grads, trl_grads, strict=True))
    assert trainer._metrics["train"]["correction/share_corrected"][-1] == (float(selected.sum()),) * 2
