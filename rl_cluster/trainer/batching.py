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

With N trainer ranks a step's rows become micro-batches of one row per rank (`micro_batches`): every
rank runs as many forwards and backwards as the others (each backward all-reduces the gradients, so a
rank with one row more would wait for ever), and rank 0, which alone pulls samples, hands each rank its
row of each micro-batch (compat item 11's broadcast).
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


def _halves(row: TreeRow) -> list[TreeRow]:
    """A row of several samples as two rows of half of them each (a group's samples stay in order, so a
    split cuts at most one group)."""
    cut = len(row.samples) // 2
    halves = [TreeRow(), TreeRow()]
    for k, sample in enumerate(row.samples):
        halves[k >= cut].add(sample)
    return halves


def micro_batches(rows: list[TreeRow], num_processes: int) -> list[list[TreeRow]]:
    """A step's rows as micro-batches of one row per rank, every rank given as many rows. Rows are split
    (the one of most samples first) until their number divides by `num_processes`: a row of one sample
    never needs to be, since a step of only such rows has `completions_per_step` of them, a multiple of
    the ranks. Each rank then gets a share of rows balanced by attention cost (costliest row first to the
    least loaded rank with room, as TRL's planner places groups), and the k-th micro-batch pairs each
    rank's k-th costliest row, so that the ranks' forwards between two all-reduces take alike."""
    rows = list(rows)
    while len(rows) % num_processes:
        largest = max(rows, key=lambda row: len(row.samples))
        if len(largest.samples) < 2:
            raise ValueError(
                f"{len(rows)} single-sample rows cannot be shared by {num_processes} ranks: a step must be a "
                "multiple of trainer.num_workers samples"
            )
        rows.remove(largest)
        rows += _halves(largest)
    per_rank = len(rows) // num_processes
    shares: list[list[TreeRow]] = [[] for _ in range(num_processes)]
    loads = [0] * num_processes
    for row in sorted(rows, key=lambda row: row.load, reverse=True):
        rank = min((r for r in range(num_processes) if len(shares[r]) < per_rank), key=lambda r: loads[r])
        shares[rank].append(row)
        loads[rank] += row.load
    return [list(batch) for batch in zip(*shares, strict=True)]


class StepPacker(torch.utils.data.IterableDataset):
    """One item per optimizer step: the next `samples_per_step` samples of `dataset` (the whole step, every
    rank's share), packed into rows (`pack_rows`) and laid out as micro-batches of one row per rank
    (`micro_batches`). It pulls exactly the samples of the step it yields, never one ahead."""

    def __init__(self, dataset: Iterable[dict[str, Any]], samples_per_step: int, token_budget: int,
                 num_processes: int = 1):  # fmt: skip
        if samples_per_step < 1 or token_budget < 1:
            raise ValueError(
                f"samples_per_step={samples_per_step}, token_budget={token_budget}: both must be > 0"
            )
        self.dataset = dataset
        self.samples_per_step = samples_per_step
        self.token_budget = token_budget
        self.num_processes = num_processes

    def __iter__(self) -> Iterator[list[list[TreeRow]]]:
        step: list[dict[str, Any]] = []
        for sample in self.dataset:
            step.append(sample)
            if len(step) == self.samples_per_step:
                yield micro_batches(pack_rows(step, self.token_budget), self.num_processes)
                step = []


def collate_step(batches: list[list[TreeRow]], collate) -> dict[str, list[dict[str, Any]]]:
    """One step's micro-batches through TRL's collator (one row per rank in each), each told the step's
    trained-token count (all ranks' rows) so its loss is normalised over the whole step."""
    micro_batches = [collate([rows]) for rows in batches]
    step_tokens = sum(float(batch["global_n_tokens"][0]) for batch in micro_batches)
    for batch in micro_batches:
        batch[STEP_TOKENS] = torch.full_like(batch["global_n_tokens"], step_tokens)
    return {MICRO_BATCHES: micro_batches}


class _PackedSteps:
    """Rank 0's steps with token_budget: one collated step per item, every rank's rows in it."""

    def __init__(self, packer: StepPacker, collate):
        self.packer = packer
        self.collate = collate

    def __iter__(self):
        for batches in self.packer:
            yield collate_step(batches, self.collate)


def packed_steps(prepared, accelerator, samples_per_step: int, token_budget: int):
    """TRL's prepared loader for `token_budget > 0`, rebuilt around `StepPacker` in place of TRL's
    TokenBudgetBatcher, over the same rollout queue and with the same collator: rank 0 packs each step of
    `samples_per_step` samples (all ranks' share), and every rank trains its rows of it (item 11)."""
    from rl_cluster.trainer.compat import BatchesAsPulled

    if not accelerator.is_main_process:  # only rank 0 has the rollout queue; the others are handed rows
        return BatchesAsPulled((), accelerator)
    base = prepared.base_dataloader
    if not isinstance(base.dataset, TokenBudgetBatcher):
        raise RuntimeError(
            f"expected TRL's TokenBudgetBatcher under the train loader, found {base.dataset!r}"
        )
    packer = StepPacker(base.dataset.dataset, samples_per_step, token_budget, accelerator.num_processes)
    return BatchesAsPulled(_PackedSteps(packer, base.collate_fn), accelerator)


def step_rows(inputs) -> list[dict[str, Any]] | None:
    """The micro-batches of a `packed_steps` item, None for any other item (TRL's own)."""
    return inputs.get(MICRO_BATCHES) if isinstance(inputs, dict) else None


def train_rows(training_step, model, rows: list[dict[str, Any]], num_items_in_batch=None):
    """One step's rows, each one forward and backward through `training_step` (TRL's), their gradients
    accumulated into the step's one optimizer update; the summed loss."""
    # With several ranks each row's backward all-reduces (every rank runs as many rows): a rank-1 LoRA's
    # gradients are a few kB, so holding the reduction back to the last row would save next to nothing.
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
