"""Every workaround for a third-party quirk in the trainer, in one place.

Each function says what it works around; `tests/unit/test_compat.py` shows each one is needed (the
unpatched code fails on a CPU machine) and that the replacement is correct.

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
   behind more than max_staleness steps of work and is then dropped as stale. `pipeline_limits` keeps
   queued + in flight within the staleness window.
9. TRL's default PrinterCallback prints every step's whole log dict (our StepReporter prints one line
   per step), and the closing log of `train()` repeats the last step with runtime totals, which must
   not count as a step of its own (`is_step_log`).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop


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


def training_precision_kwargs() -> dict:
    """TRL's AsyncGRPOConfig turns bf16 on by default, which fails on a CPU: train in the model's dtype."""
    if torch.cuda.is_available():
        return {}
    return {"bf16": False, "fp16": False, "use_cpu": True}


def name_run_adapters(trainer, prefix: str) -> None:
    """Publish `<prefix>-vN` instead of TRL's fixed `trl-policy-vN` (before train(): the rollout worker
    reads the name when its process starts)."""
    trainer._lora_name = prefix
    trainer.rollout_worker._loop_kwargs["lora_name"] = prefix


def bound_score_queue(trainer, groups: int) -> None:
    """Let at most `groups` finished groups wait for scoring (before train())."""
    trainer.rollout_worker._loop_kwargs["score_queue_maxsize"] = groups


# The version the group of the sample being generated was pinned to (set per sample's asyncio task).
_GROUP_VERSION: contextvars.ContextVar[int | None] = contextvars.ContextVar("group_version", default=None)


class GroupPinnedRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop, with every sample of a group generated under the group's version (item 6).

    `pinned_window`: how many versions back a pinned group may ask for. An older group is dropped as
    stale when scored, and its adapter may be unloaded already (the trainer unloads versions that left
    the window), so its remaining samples ask for the newest version instead of failing.
    """

    def __init__(self, *args, pinned_window: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.pinned_window = pinned_window
        self._group_versions: dict[int, list[int]] = {}  # group id -> [version, samples dispatched]

    def _generate_one(self, prompt, tool_dict, tools, group_id: int = 0):
        # Not a coroutine function on purpose: this body runs when the generate loop dispatches the sample,
        # in the same synchronous stretch in which it created the group and read its version.
        entry = self._group_versions.setdefault(group_id, [self.model_version, 0])
        entry[1] += 1
        if entry[1] >= self.num_generations:
            del self._group_versions[group_id]  # every sample dispatched
        return self._generate_pinned(entry[0], prompt, tool_dict=tool_dict, tools=tools, group_id=group_id)

    async def _generate_pinned(self, version: int, *args, **kwargs):
        _GROUP_VERSION.set(version)  # this sample's task has its own context
        return await super()._generate_one(*args, **kwargs)

    @property
    def _request_model(self) -> str:
        pinned = _GROUP_VERSION.get()
        if self.lora_name is None or pinned is None or self.model_version - pinned > self.pinned_window:
            return super()._request_model
        return f"{self.lora_name}-v{pinned}"


def pin_group_versions(trainer, window: int) -> None:
    """Generate each group under one adapter version (item 6); before train(), which spawns the loop."""
    worker = trainer.rollout_worker
    if worker._loop_cls is not _AsyncRolloutLoop:
        raise RuntimeError(f"pin_group_versions would replace a custom rollout loop {worker._loop_cls!r}")
    worker._loop_cls = GroupPinnedRolloutLoop
    worker._loop_kwargs["pinned_window"] = window


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


def pipeline_limits(completions_per_step: int, queue_steps: int, max_staleness: int) -> dict:
    """AsyncGRPOConfig's queue and in-flight bounds (item 8): a sample waits behind everything queued and
    in flight; keep that under max_staleness steps' worth, or most of what is generated goes stale."""
    return {
        "queue_maxsize": completions_per_step * queue_steps,
        "max_inflight_tasks": completions_per_step * max(1, max_staleness - queue_steps),
    }


def quiet_default_printer(trainer) -> None:
    """Drop TRL's per-step dict printer (item 9): the run prints its own progress line per step."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)


def is_step_log(logs: dict | None) -> bool:
    """False for the closing log of `train()` (runtime totals, repeating the last step) (item 9)."""
    return bool(logs) and "train_runtime" not in logs
