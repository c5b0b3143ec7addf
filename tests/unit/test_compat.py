"""Each trainer workaround is needed on this machine, and the replacement is correct."""

import pytest
import torch
import torch.nn.functional as F

from rl_cluster.trainer import compat


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


@pytest.mark.parametrize("lengths_q,lengths_k", [([3, 5, 1], [3, 5, 1]), ([2, 4], [5, 4])])
def test_varlen_attention_matches_reference(lengths_q, lengths_k):
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    q = torch.randn(sum(lengths_q), heads, dim)
    k = torch.randn(sum(lengths_k), kv_heads, dim)
    v = torch.randn(sum(lengths_k), kv_heads, dim)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()])
    out = compat.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    torch.testing.assert_close(out, reference_attention(q, k, v, lengths_q, lengths_k), atol=1e-5, rtol=1e-5)


def test_varlen_attention_is_differentiable():
    q = torch.randn(4, 2, 8, requires_grad=True)
    k = torch.randn(4, 1, 8, requires_grad=True)
    v = torch.randn(4, 1, 8, requires_grad=True)
    cu = torch.tensor([0, 1, 4])
    compat.varlen_attention(q, k, v, cu, cu, 3, 3).sum().backward()
    assert q.grad is not None and k.grad.abs().sum() > 0


def test_unpatched_trl_attention_kernel_fails_here(monkeypatch):
    """Without the workaround TRL fetches a CUDA kernel from a hub: impossible on this machine."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from trl.experimental.async_grpo import packing

    original = getattr(packing, "_rl_cluster_original_flash_attn", packing._flash_attn)
    if hasattr(original, "cache_clear"):
        original.cache_clear()
    with pytest.raises(Exception):  # noqa: B017 - ImportError (no `kernels`) or a hub/CUDA error
        _ = original().flash_attn_varlen_func


def test_unpatched_mfu_probe_fails_on_cpu():
    from trl.trainer.utils import get_peak_flops_per_device

    assert not torch.cuda.is_available()
    with pytest.raises((AssertionError, RuntimeError)):
        get_peak_flops_per_device(type("Acc", (), {"device": torch.device("cpu")})(), "float32")


def test_workarounds_install_and_are_idempotent():
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    compat.apply_trainer_workarounds()
    compat.apply_trainer_workarounds()
    assert packing._flash_attn().flash_attn_varlen_func is compat.varlen_attention
    acc = type("Acc", (), {"device": torch.device("cpu")})()
    assert async_grpo_trainer.get_peak_flops_per_device(acc, "float32") is None
    assert compat.training_precision_kwargs()["bf16"] is False


def test_trl_fixes_the_adapter_name_and_the_score_queue():
    """What name_run_adapters and bound_score_queue change is hard-wired in TRL 1.16."""
    import inspect

    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    assert 'self._lora_name = "trl-policy"' in inspect.getsource(AsyncGRPOTrainer.__init__)
    assert inspect.signature(_AsyncRolloutLoop.__init__).parameters["score_queue_maxsize"].default == 16

    worker = type("Worker", (), {"_loop_kwargs": {"lora_name": "trl-policy", "score_queue_maxsize": 16}})()
    trainer = type("Trainer", (), {"rollout_worker": worker, "_lora_name": "trl-policy"})()
    compat.name_run_adapters(trainer, "run-a")
    compat.bound_score_queue(trainer, 4)
    assert trainer._lora_name == "run-a"
    assert worker._loop_kwargs == {"lora_name": "run-a", "score_queue_maxsize": 4}
