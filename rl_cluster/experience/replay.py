"""Replay stored samples into a policy offline: rescore their completion tokens under a base model and
(optionally) a PEFT adapter, on the CPU, to see how far that policy is from the one that sampled them
(rl_cluster.core.experience.replay_stats does the arithmetic)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def load_policy(model_dir: str | Path, adapter_dir: str | Path | None = None):
    """The base model (float32, eval mode) with the adapter applied when one is given."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def rescore(model, rows: Sequence[Mapping[str, Any]], *, batch_size: int = 4) -> list[list[float]]:
    """Per row, `model`'s logprob of each completion token given the tokens before it (0.0 for a token at
    position 0, which has none). Rows are right-padded into batches of `batch_size`."""
    import torch

    out: list[list[float]] = []
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        seqs_B = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in batch]
        ids_BT = torch.zeros(len(batch), max(map(len, seqs_B)), dtype=torch.long)
        mask_BT = torch.zeros_like(ids_BT)
        for b, seq in enumerate(seqs_B):
            ids_BT[b, : len(seq)] = torch.tensor(seq)
            mask_BT[b, : len(seq)] = 1
        with torch.no_grad():
            logits_BTV = model(input_ids=ids_BT, attention_mask=mask_BT).logits.float()
        # logp_BT[b, p - 1]: the logprob of token p given tokens < p.
        logp_BT = torch.log_softmax(logits_BTV[:, :-1], dim=-1).gather(-1, ids_BT[:, 1:, None])[..., 0]
        for b, row in enumerate(batch):
            start, n = len(row["prompt_ids"]), len(row["completion_ids"])
            values = logp_BT[b, max(start - 1, 0) : start - 1 + n].tolist()
            out.append(values if start else [0.0, *values])
    return out
