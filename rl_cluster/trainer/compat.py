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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
