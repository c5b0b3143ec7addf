"""Token-budgeted packing that keeps the GRPO step the run configured (compat item 16).

TRL 1.16's `TokenBudgetBatcher` (chosen whenever `token_budget > 0`) makes each optimizer step one
micro-batch filled to `token_budget` unique tokens, however many samples that takes, and closes it only
on pulling the next sample, the one that does not fit. rl_cluster's admission window counts
`completions_per_step` samples per step (rl_cluster.core.admission): when a filled micro-batch needs
more samples than admission lets generate before the next sync (which needs a step), the trainer
waits for ever. Here a step is exactly `completions_per_step` samples, as admission counts them, and
`token_budget` bounds what one forward holds: the step's samples are packed into rows of at most
`token_budget` unique tokens, each row one forward and backward, their gradients accumulated into the
step's one optimizer update and normalised over the whole step's tokens (the same gradient as one
forward over all of them).

The Trainer loop runs one optimizer step per `gradient_accumulation_steps` items and cannot take a
number of micro-batches that varies per step, so the loader yields one item per step,
`{"micro_batches": [...]}`, and the trainer's `training_step` runs its rows (`train_rows`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from trl.experimental.async_grpo.async_grpo_trainer import TokenBudgetBatcher
from trl.experimental.async_grpo.packing import TreeRow

MICRO_BATCHES = "micro_batches"
STEP_TOKENS = "step_n_tokens"


def pack_rows(samples: list[dict[str, Any]], token_budget: int) -> list[TreeRow]:
    """The samples in rows of at most `token_budget` unique (and trained) tokens. Rows run one after
    another, so there is no load to balance, only forwards to save: a group goes whole into the fullest
    row with room for all of it (its prompt is forwarded once), else whole into a new row; a group
    larger than a row goes sample by sample, to a row holding the group if one has room, else to the
    fullest row it fits, else to a new row."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for sample in samples:
        n = len(sample["input_ids"])
        if n > token_budget:
            # Config validation keeps token_budget >= model.max_model_len (the cap on prompt + completion).
            # TRL drops such a sample, but then the step waits for one more than admission lets generate.
            raise ValueError(f"a rollout sample of {n} tokens exceeds trainer.token_budget={token_budget}")
        groups.setdefault(sample["group_id"], []).append(sample)
    rows: list[TreeRow] = []

    def fullest(candidates: list[TreeRow]) -> TreeRow | None:
        return max(candidates, key=lambda row: len(row.tokens), default=None)

    for group in groups.values():
        alone = TreeRow()
        for sample in group:
            alone.add(sample)
        if len(alone.tokens) <= token_budget and alone.trained <= token_budget:
            # What the group adds to a row is at most what it costs alone (it may share a system prompt).
            row = fullest([r for r in rows if _has_room(r, alone, token_budget)])
            if row is None:
                rows.append(alone)
                continue
            for sample in group:
                row.add(sample)
            continue
        for sample in group:
            fitting = [row for row in rows if row.fits(sample, token_budget)]
            row = fullest([row for row in fitting if sample["group_id"] in row.groups] or fitting)
            if row is None:
                row = TreeRow()
                rows.append(row)
            row.add(sample)
    return rows


def _has_room(row: TreeRow, group: TreeRow, token_budget: int) -> bool:
    return len(row.tokens) + len(group.tokens) <= token_budget and row.trained + group.trained <= token_budget


class StepPacker(torch.utils.data.IterableDataset):
    """One item per optimizer step: the next `samples_per_step` samples of `dataset`, packed into rows
    (`pack_rows`). It pulls exactly the samples of the step it yields, never one ahead."""

    def __init__(self, dataset: Iterable[dict[str, Any]], samples_per_step: int, token_budget: int):
        if samples_per_step < 1 or token_budget < 1:
            raise ValueError(
                f"samples_per_step={samples_per_step}, token_budget={token_budget}: both must be > 0"
            )
        self.dataset = dataset
        self.samples_per_step = samples_per_step
        self.token_budget = token_budget

    def __iter__(self) -> Iterator[list[TreeRow]]:
        step: list[dict[str, Any]] = []
        for sample in self.dataset:
            step.append(sample)
            if len(step) == self.samples_per_step:
                yield pack_rows(step, self.token_budget)
                step = []


def collate_step(rows: list[TreeRow], collate) -> dict[str, list[dict[str, Any]]]:
    """One step's rows through TRL's collator (one row per micro-batch: one process), each micro-batch
    told the step's trained-token count so its loss is normalised over the whole step."""
    micro_batches = [collate([[row]]) for row in rows]
    step_tokens = sum(float(batch["global_n_tokens"][0]) for batch in micro_batches)
    for batch in micro_batches:
        batch[STEP_TOKENS] = torch.full_like(batch["global_n_tokens"], step_tokens)
    return {MICRO_BATCHES: micro_batches}


class _PackedSteps:
    """The trainer's loader with token_budget: one collated step per item, on the device."""

    def __init__(self, packer: StepPacker, collate, device):
        self.packer = packer
        self.collate = collate
        self.device = device

    def __iter__(self):
        from accelerate.utils import send_to_device

        for rows in self.packer:
            yield send_to_device(collate_step(rows, self.collate), self.device)


def packed_steps(prepared, accelerator, samples_per_step: int, token_budget: int) -> _PackedSteps:
    """TRL's prepared loader for `token_budget > 0`, rebuilt around `StepPacker` in place of TRL's
    TokenBudgetBatcher, over the same rollout queue and with the same collator."""
    if accelerator.num_processes != 1:
        raise ValueError("trainer.token_budget > 0 packs for one trainer process; use 0 with several")
    base = prepared.base_dataloader
    if not isinstance(base.dataset, TokenBudgetBatcher):
        raise RuntimeError(
            f"expected TRL's TokenBudgetBatcher under the train loader, found {base.dataset!r}"
        )
    packer = StepPacker(base.dataset.dataset, samples_per_step, token_budget)
    return _PackedSteps(packer, base.collate_fn, accelerator.device)


def step_rows(inputs) -> list[dict[str, Any]] | None:
    """The micro-batches of a `packed_steps` item, None for any other item (TRL's own)."""
    return inputs.get(MICRO_BATCHES) if isinstance(inputs, dict) else None


def train_rows(training_step, model, rows: list[dict[str, Any]], num_items_in_batch=None):
    """One step's rows, each one forward and backward through `training_step` (TRL's), their gradients
    accumulated into the step's one optimizer update; the summed loss."""
    # One trainer process (packed_steps refuses more): no gradient reduction to hold back between rows.
    total = 0
    for batch in rows:
        total = total + training_step(model, batch, num_items_in_batch)
    return total


def over_step_tokens(loss, inputs):
    """A row's loss as TRL normalises it (over the row's own trained tokens), normalised over the step's
    tokens instead: the rows' gradients add up to the step's token mean. Other items pass unchanged."""
    if STEP_TOKENS not in inputs:
        return loss
    return loss * inputs["global_n_tokens"][0] / inputs[STEP_TOKENS][0].clamp(min=1.0)
