"""Every workaround for a third-party quirk in the trainer, in one place.

Each function says what it works around; `tests/unit/test_compat.py` shows each one is needed (the
unpatched code fails on a CPU machine) and that the replacement is correct. Checked on the pinned TRL
1.16.0, transformers 5.19 and accelerate 1.16.0: an item is retired when an upgrade makes its test's
"needed" half fail (the upstream code no longer misbehaves). Items 6, 10, 12 to 15, 23 and the loop's
half of 19 are carried by the rollout child's loop (rl_cluster/trainer/rollout.py), item 16 by
rl_cluster/trainer/batching.py; the rest are here.

1. TRL 1.16's AsyncGRPOTrainer packs samples into a "tree" and runs attention through a CUDA
   flash-attention-3 kernel fetched from a model hub at run time (`packing._flash_attn`). On a CPU
   (and offline) there is no such kernel: we give it a varlen attention built on
   `torch.nn.functional.scaled_dot_product_attention` with the same calling convention.
2. `get_peak_flops_per_device` (the MFU probe) calls `torch.cuda.get_device_name` unconditionally,
   which raises on a CPU-only torch: without CUDA we report "unknown peak" (MFU off), as TRL does for
   unknown GPUs.
3. `bf16` defaults to on in AsyncGRPOConfig and fails on a CPU.
4. The adapter name prefix is hard-coded (`trl-policy`), for every run: a second run against the same
   servers collides ("already loaded"), and vLLM keys its prefix cache by name.
5. The rollout worker's score queue holds 16 groups, not configurable: on a small batch that is
   several steps' worth of finished samples waiting, which then go stale and are dropped.
6. The rollout loop names the adapter of each *request* after the policy version current when the
   request is sent (`_AsyncRolloutLoop._request_model` reads the shared version), while the group's
   staleness is counted from the version current when its first sample was dispatched. When the
   in-flight slots run out mid-group (they do: TRL dispatches a group's samples as slots free up), a
   sync in between splits the group across two adapters: two prompt prefixes (so two replicas and two
   KV caches), and samples of a newer policy scored as older ones. `GroupPinnedRolloutLoop` asks for
   the group's own version for all its samples, to the last token.
7. The trainer's model runs TRL's packed "tree" attention, which needs packing metadata
   (`tree_kv_index`, ...) on every forward: a plain forward (the served-vs-trained check scores whole
   sequences) fails with a TypeError. `plain_attention` switches the model to SDPA for a moment.
8. TRL's default pipeline limits let generation run ahead of training: `queue_maxsize` 1024 samples
   and `max_inflight_tasks` max_staleness steps' worth *on top of* the queue, so a sample can wait
   behind more than max_staleness steps of work and is then dropped as stale. With admission (item 10)
   doing the bounding, `pipeline_limits` sizes both so that they never bind before it.
9. TRL's default PrinterCallback prints every step's whole log dict (our StepReporter prints one line
   per step), and the closing log of `train()` repeats the last step with runtime totals, which must
   not count as a step of its own (`is_step_log`).
10. TRL starts a group whenever an in-flight slot is free, however far generation is ahead of the
   trainer; what the trainer cannot consume within max_staleness versions is generated and then dropped
   (31 % of the demo's samples). `GroupPinnedRolloutLoop` also admits groups
   (rl_cluster.core.admission): a group's first sample waits until the group fits under the limit the
   trainer sets at each sync, and the group's version is the one current when it was admitted.
11. accelerate's prepared DataLoader (`DataLoaderDispatcher`, also `DataLoaderShard`) fetches the batch
   after the one it yields, to see the end of the data coming: before step k trains, step k+1's
   samples are pulled. A lockstep trainer (step k+1 generated after sync k) then waits forever for
   samples that are only admitted after step k, and the async one judges staleness a step early.
   `without_lookahead` yields each batch as it is pulled; with several ranks, rank 0 pulls it when
   the step starts and broadcasts it, and each rank keeps its row, as the dispatcher does a batch later.
12. The rollout loop's kwargs travel to a spawned child. TRL first `pickle.dumps` them to fail early on
   lambdas, outside spawning, where multiprocessing's shared arrays cannot be pickled, so TRL refuses
   to start ("must be picklable"): `TrainerPosition` pickles to a placeholder for that check.
13. When training ends, the rollout child exits with scored samples nobody will read still in the
   rollout buffer; a multiprocessing queue's exiting process waits until its feeder thread wrote them
   all into the pipe, which blocks once the pipe is full. TRL then waits 15 s and terminates it ("Child
   did not exit within 15s"). The loop lets the buffer go on stop (`cancel_join_thread`).
14. The rollout child is a `daemon` process, which only matters when its parent exits normally: when the
   trainer process is killed (SIGKILL, the OOM killer, a lost actor), the child lives on, generating
   against the proxy for a trainer that is gone, beside the restarted one. `exit_with_parent` ends it
   when its parent's sentinel closes.
15. TRL tells reward functions nothing about truncation (no finish reason), yet a completion cut off
   at max_new_tokens must not earn a reward for a half-written answer. The loop passes
   `truncated` (one bool per completion) by TRL's own rule for its `completions/clipped_ratio`: the
   completion does not end on an EOS or pad token. Reward functions take `**kwargs`; the math graders
   score a truncated completion 0.
16. With `token_budget > 0`, TRL's `TokenBudgetBatcher` makes each optimizer step one micro-batch
   filled to `token_budget` unique tokens, however many samples that is (gradient accumulation 1), and
   closes it only on pulling the next sample, the one that does not fit. Admission (item 10) lets
   `completions_per_step` samples per step be generated: a micro-batch that needs more than the window
   holds, or just the one pulled ahead of it, is never completed, and the trainer waits for ever (the
   recipes' 16,384 tokens; 1,024 too on the tiny model, in lockstep as in async mode). The loader of
   `rl_cluster.trainer.batching` replaces it: a step is exactly `completions_per_step` samples, pulled
   without look-ahead and packed into rows of at most `token_budget` tokens, trained as gradient
   accumulation within the one optimizer step (with N ranks, micro-batches of one row per rank).
17. transformers' Trainer, resumed from a checkpoint at `max_steps`, trains one step more. With a loader
   of no length (AsyncGRPOTrainer's rollout queue) an "epoch" is `max_steps` updates, so the resume starts
   at epoch `global_step // max_steps` = 1, whose first update runs before the stop check: a run whose
   newest checkpoint is its last step trained step max_steps + 1 on resume (a driver killed after the
   final checkpoint, or a trainer Ray restarted then). `train_to_max_steps` trains nothing in that case.
18. AsyncGRPOTrainer's adapter sync has no hook: it writes into its own directory and loads from there
   (`_sync_weight_lora`, private), and what a replacement needs is private too (`_lora_sync`,
   `_lora_name`, `_adapter_name`, `_trained_groups`, the rollout worker's `_mp_ctx`, the step's
   `_metrics`). `AdapterSyncTrainer` routes the sync to `sync_adapter` and names those attributes
   publicly (`train_metrics` the metrics, for any TRL trainer), so the rest of the package touches no
   private attribute of TRL's (tests/unit/test_private_access.py checks it).
19. TRL's clients of the server send no Authorization header: the VLLMClient that AsyncGRPOTrainer's
   `__init__` makes and probes at once (`/server_info`, `/v1/models`), and the rollout loop's generation
   posts (`_post`, in the spawned child). The proxy demands the run's token on every route but /health and
   /metrics. `AdapterSyncTrainer(proxy_token=...)` replaces the client as TRL assigns it with an
   `AuthorizedVLLMClient`, and `GroupPinnedRolloutLoop(auth_token=...)` posts with the header.
20. AsyncGRPOTrainer adds two `StepIntervalCallback`s (the sync and the step metrics), by design, and
   transformers warns on the second that "there is already one", with the whole callback list: 8 lines
   of every run's console. `AdapterSyncTrainer.add_callback` adds TRL's interval callbacks without it.
21. AsyncGRPOTrainer's loss only clips its ratio against vLLM's logprobs (TRL #6945, #7120 ask for
   importance-sampling corrections; none in 1.16), and `compute_loss` computes the forward, the loss, its
   metrics and the step's accounting in one private body. `captured_forward` hands TRL's compute_loss a
   model that keeps the forward's outputs, so the off-policy correction (rl_cluster.trainer.correction)
   computes its loss from the same forward while TRL's metrics and accounting stay TRL's. Retire when
   TRL's loss takes a correction of its own.
22. accelerate 1.16 on a CPU machine drops an FSDP plugin without a word: `AcceleratorState` turns to
   FSDP only on accelerator devices, so with `use_cpu` the ranks keep `MULTI_CPU` and the model is
   wrapped in DDP (and with `use_cpu=False` on a CPU-only torch each rank believes it is alone). Yet
   torch's `fully_shard` runs on CPU over gloo. `apply_trainer_workarounds` makes a multi-CPU state that
   was given a plugin an FSDP one, as on GPUs: `trainer.strategy = "fsdp2"` is then sharded on CPU too.
23. TRL spawns the rollout child only once training begins, after the first weight sync, and a spawned
   child imports torch, transformers and TRL afresh: ~15 s of one core on every trainer start and
   restart, with the rank idle meanwhile. The loop's worker starts it from a fork server instead
   (`rollout_context`), which rank 0 starts as its training begins (`start_rollout_server`) and which
   imports the stack while the rank loads its model and publishes its first version; the child is a
   fork of it, and, as a spawned one, inherits nothing of the rank (no CUDA, no threads).

What retires each item (searched upstream trackers, 2026-12; "none filed" means no upstream issue was
found, and the item goes when a release changes the behaviour its test shows):
- 1: TRL's packing taking a local attention (AsyncGRPO is flash-attention only since TRL #5854); none
  filed for CPU. 2: TRL guarding `torch.cuda` in `get_peak_flops_per_device`; none filed.
- 3, 4, 5, 8, 9, 20: AsyncGRPOConfig options for precision on CPU, the adapter name, the score queue,
  and TRL's printer and interval callbacks; none filed.
- 6, 10, 12, 13, 14, 15, 19: the rollout loop pinning a group's version, an admission hook, a spawn check
  that allows shared arrays, a child that follows its parent, finish reasons for rewards and an auth
  header; none filed (TRL's AsyncGRPO is `experimental` and changes every release).
- 11, 16: accelerate's dispatcher without read-ahead and TRL's batcher closing a step at a sample count;
  none filed (accelerate #2162 discusses the dispatcher's design).
- 17: transformers #26413 (resume with a dataset without length; the PR #33544 is open).
- 18: a public sync hook in AsyncGRPOTrainer; none filed. 21: TRL #6945, #7120. 22: none filed
  (accelerate's FSDP on CPU); its test fails when accelerate keeps the plugin by itself.
- 23: a choice of the rollout child's start method (or its start at construction); none filed.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, StepIntervalCallback
from trl.experimental.async_grpo.vllm_client import VLLMClient

from rl_cluster.core.admission import AdmissionWindow
from rl_cluster.trainer.http import HttpClient


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
) -> torch.Tensor:
    """flash_attn_varlen_func on SDPA. q_TqHD, k_TkKD, v_TkKD packed; segment i is rows
    cu_seqlens[i]:cu_seqlens[i+1]. Causality is bottom-right aligned as in flash-attention: when a
    segment has fewer queries than keys, its queries are the last ones."""
    if softcap:
        raise NotImplementedError(
            "softcap attention has no SDPA equivalent here; use a GPU with flash-attention"
        )
    heads_per_kv = q.shape[1] // k.shape[1]
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for i in range(len(starts_q) - 1):
        q_HLD = q[starts_q[i] : starts_q[i + 1]].transpose(0, 1)
        k_HSD = k[starts_k[i] : starts_k[i + 1]].transpose(0, 1).repeat_interleave(heads_per_kv, 0)
        v_HSD = v[starts_k[i] : starts_k[i + 1]].transpose(0, 1).repeat_interleave(heads_per_kv, 0)
        len_q, len_k = q_HLD.shape[1], k_HSD.shape[1]
        mask_LS = None
        if causal or window_size[0] >= 0:
            query_pos = torch.arange(len_q, device=q.device)[:, None] + (len_k - len_q)
            key_pos = torch.arange(len_k, device=q.device)[None, :]
            mask_LS = key_pos <= query_pos if causal else torch.ones(len_q, len_k, dtype=torch.bool)
            if window_size[0] >= 0:
                mask_LS &= key_pos >= query_pos - window_size[0]
        out_HLD = F.scaled_dot_product_attention(q_HLD, k_HSD, v_HSD, attn_mask=mask_LS, scale=softmax_scale)
        outs.append(out_HLD.transpose(0, 1))
    return torch.cat(outs, dim=0)


class _SdpaVarlenKernel:
    """Stands where TRL expects the hub kernel module: only `flash_attn_varlen_func` is used."""

    flash_attn_varlen_func = staticmethod(varlen_attention)


def _peak_flops_or_none(original):
    def peak_flops(accelerator, dtype):
        if not torch.cuda.is_available():
            return None
        return original(accelerator, dtype)

    return peak_flops


def apply_trainer_workarounds() -> None:
    """Patch TRL for this machine. Idempotent; on a CUDA machine the flash-attention kernel stays."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    if not torch.cuda.is_available():
        # Keep TRL's own function reachable (the test that shows the workaround is needed calls it).
        packing.__dict__.setdefault("_rl_cluster_original_flash_attn", packing._flash_attn)
        packing._flash_attn = lambda: _SdpaVarlenKernel
    if not getattr(async_grpo_trainer.get_peak_flops_per_device, "_rl_cluster_patched", False):
        patched = _peak_flops_or_none(async_grpo_trainer.get_peak_flops_per_device)
        patched._rl_cluster_patched = True
        async_grpo_trainer.get_peak_flops_per_device = patched
    if not torch.cuda.is_available():
        shard_on_cpu()


def _fsdp_on_cpu(original):
    def init(self, *args, fsdp_plugin=None, **kwargs):
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type

    init._rl_cluster_patched = True
    return init


def shard_on_cpu() -> None:
    """Item 22: an FSDP plugin given to accelerate on CPU ranks makes them FSDP ranks. Idempotent."""
    from accelerate.state import AcceleratorState

    if not getattr(AcceleratorState.__init__, "_rl_cluster_patched", False):
        AcceleratorState.__init__ = _fsdp_on_cpu(AcceleratorState.__init__)


def training_precision_kwargs() -> dict:
    """TRL's AsyncGRPOConfig turns bf16 on by default, which fails on a CPU: train in the model's dtype."""
    if torch.cuda.is_available():
        return {}
    return {"bf16": False, "fp16": False, "use_cpu": True}


def name_run_adapters(trainer, prefix: str) -> None:
    """Publish `<prefix>-vN` instead of TRL's fixed `trl-policy-vN` (before train(): the rollout worker
    reads the name when its process starts)."""
    trainer._lora_name = prefix
    if trainer.rollout_worker is not None:  # rank 0's
        trainer.rollout_worker._loop_kwargs["lora_name"] = prefix


def bound_score_queue(trainer, groups: int) -> None:
    """Let at most `groups` finished groups wait for scoring (before train())."""
    trainer.rollout_worker._loop_kwargs["score_queue_maxsize"] = groups


class BatchesAsPulled:
    """Each batch moved to the device as it is pulled, no look-ahead (item 11). With several ranks, rank 0
    pulls (the others' loaders are empty), broadcasts the batch of one row per rank, and each keeps its
    row; None tells every rank that the data ended."""

    def __init__(self, dataloader, accelerator):
        self.dataloader = dataloader
        self.accelerator = accelerator

    def __iter__(self):
        from accelerate.utils import broadcast_object_list, send_to_device, slice_tensors

        a = self.accelerator
        pulled = iter(self.dataloader)  # on every rank, as accelerate's dispatcher does
        if a.num_processes == 1:
            for batch in pulled:
                yield send_to_device(batch, a.device)
            return
        while True:
            batch = next(pulled, None) if a.is_main_process else None
            batch = broadcast_object_list([batch], from_process=0)[0]
            if batch is None:
                return
            yield send_to_device(slice_tensors(batch, slice(a.process_index, a.process_index + 1)), a.device)


def without_lookahead(prepared, accelerator):
    """The trainer's DataLoader without accelerate's fetch-ahead (item 11)."""
    return BatchesAsPulled(prepared.base_dataloader, accelerator)


@contextlib.contextmanager
def plain_attention(model):
    """Run a model built with TRL's packed tree attention with standard SDPA attention for a moment (item 7)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    previous = inner.config._attn_implementation
    inner.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        inner.set_attn_implementation(previous)


class _CapturedForward:
    """The model, called as TRL's compute_loss calls it, keeping what the call returned (item 21)."""

    def __init__(self, model):
        self.model = model
        self.outputs = None

    def __call__(self, *args, **kwargs):
        self.outputs = self.model(*args, **kwargs)
        return self.outputs


def captured_forward(model) -> _CapturedForward:
    return _CapturedForward(model)


def train_metrics(trainer) -> dict[str, list]:
    """TRL's training metrics of the step under way (private `_metrics["train"]`, item 18): what is
    appended here is reduced and logged with TRL's own at the step's end."""
    return trainer._metrics["train"]


def pipeline_limits(window: AdmissionWindow, num_generations: int) -> dict:
    """AsyncGRPOConfig's queue and in-flight bounds (item 8). TRL's defaults (1024 queued samples, and
    max_staleness steps' worth in flight on top) let generation run far ahead; with admission (item 10)
    the bound is the window, so size both to never bind before it: at most `window.limit(0)` samples are
    admitted and not yet pulled, plus one group of samples waiting at admission in their slots."""
    admitted = window.limit(pulled=0)
    return {"queue_maxsize": admitted, "max_inflight_tasks": admitted + num_generations}


def quiet_default_printer(trainer) -> None:
    """Drop TRL's per-step dict printer (item 9): the run prints its own progress line per step."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)


def is_step_log(logs: dict | None) -> bool:
    """False for the closing log of `train()` (runtime totals, repeating the last step) (item 9)."""
    return bool(logs) and "train_runtime" not in logs


def train_to_max_steps(trainer, checkpoint: str | None):
    """`trainer.train(resume_from_checkpoint=checkpoint)`, except that a checkpoint already at max_steps
    trains nothing (item 17); None then. A checkpoint past max_steps is the caller's error."""
    if checkpoint is not None:
        from transformers.trainer import TRAINER_STATE_NAME

        step = json.loads((Path(checkpoint) / TRAINER_STATE_NAME).read_text())["global_step"]
        if step > trainer.args.max_steps:
            raise ValueError(
                f"the checkpoint is at step {step}, past max_steps={trainer.args.max_steps}: resume with "
                f"trainer.max_steps above {step} to train further"
            )
        if step == trainer.args.max_steps:
            return None
    return trainer.train(resume_from_checkpoint=checkpoint)


class AuthorizedVLLMClient(VLLMClient):
    """TRL's server client, sending a bearer token with the probes AsyncGRPOTrainer makes (item 19)."""

    def __init__(self, server_url: str, server_timeout: float = 240.0, auth_token: str | None = None):
        super().__init__(server_url, server_timeout)
        self.http = HttpClient(server_url, auth_token, timeout_s=60)

    def _get(self, route: str, **params) -> dict:
        return self.http.request("GET", route, params=params).json()

    def get_max_model_len(self) -> int:
        return self._get("/v1/models")["data"][0]["max_model_len"]

    def get_dtype(self) -> str:
        return self.get_server_info()["model_config"]["dtype"]

    def get_server_info(self) -> dict:
        return self._get("/server_info", config_format="json")["vllm_config"]


class AdapterSyncTrainer(AsyncGRPOTrainer):
    """TRL's trainer whose adapter sync is `sync_adapter(t0)`, with the private state it needs named (item
    18), and whose server client sends `proxy_token` (item 19). `sync_adapter` returns what TRL's sync
    does: (saved, published, routable) times."""

    def __init__(self, *args, proxy_token: str | None = None, **kwargs):
        self.proxy_token = proxy_token  # before TRL's __init__, which makes the client and probes with it
        super().__init__(*args, **kwargs)

    def add_callback(self, callback) -> None:
        if isinstance(callback, StepIntervalCallback):  # item 20: TRL's own, meant to be several
            self.callback_handler.callbacks.append(callback)
        else:
            super().add_callback(callback)

    @property
    def vllm_client(self) -> VLLMClient | None:
        return self.__dict__.get("vllm_client")

    @vllm_client.setter
    def vllm_client(self, client: VLLMClient | None) -> None:
        # TRL assigns a plain VLLMClient (rank 0) or None in __init__: keep its URL and timeout, add the token.
        if client is not None and not isinstance(client, AuthorizedVLLMClient):
            client = AuthorizedVLLMClient(client.server_url, client.server_timeout, self.proxy_token)
        self.__dict__["vllm_client"] = client

    def _sync_weight_lora(self, t0: float) -> tuple[float, float, float]:
        return self.sync_adapter(t0)

    def sync_adapter(self, t0: float) -> tuple[float, float, float]:
        raise NotImplementedError

    @property
    def syncs_adapters(self) -> bool:
        """TRL chose adapter-only syncs (a PEFT model and a server started with --enable-lora)."""
        return self._lora_sync

    @property
    def adapter_prefix(self) -> str:
        """The published name's prefix: `<prefix>-vN` (name_run_adapters sets it)."""
        return self._lora_name

    @property
    def peft_adapter(self) -> str:
        """The PEFT adapter being trained (the one `save_lora_adapter` saves)."""
        return self._adapter_name

    @property
    def trained_group_ids(self) -> set[int]:
        """Groups this trainer process trained (TRL's own record, also what its checkpoints count)."""
        return self._trained_groups

    @property
    def rollout_context(self):
        """The multiprocessing context the rollout child is spawned with (shared arrays must come from it)."""
        return self.rollout_worker._mp_ctx
