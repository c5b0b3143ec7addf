"""The served-vs-trained check computes the trainer's logprobs in other dtypes and with other LoRA weights
(rl_cluster.trainer.check: computed_in, lora_weights), swapped in during each forward: the module's own
parameters must come back as they were, still hooked into DDP (a 2-rank run hung when rank 0's check had
swapped its parameters' data to float64: their gradients were never all-reduced again), and tied weights
must be swapped together. (Under FSDP2: tests/unit/test_compat.py, item 22.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rl_cluster.trainer.check import computed_in, lora_weights


def accumulator(p: nn.Parameter):
    """The node that accumulates p's gradient: DDP hooks each one (with find_unused_parameters, as the
    Trainer wraps it, it also looks for them in every forward's graph)."""
    return p.view_as(p).grad_fn.next_functions[0][0]


def test_a_check_in_float64_keeps_each_parameter_and_its_gradient_accumulator():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    originals = list(model.parameters())
    before = [accumulator(p) for p in originals]
    with computed_in(model, torch.float64):
        assert model(torch.randn(3, 4, dtype=torch.float64)).dtype == torch.float64  # swapped for the forward
        assert list(model.parameters()) == originals  # and back after it
    assert list(model.parameters()) == originals and all(p.dtype == torch.float32 for p in originals)
    assert all(accumulator(p) is node for p, node in zip(originals, before, strict=True))


def test_a_forward_that_raises_leaves_the_original_parameters():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    originals = list(model.parameters())
    with pytest.raises(RuntimeError), computed_in(model, torch.float64):
        model(torch.randn(3, 5, dtype=torch.float64))  # the wrong width
    assert list(model.parameters()) == originals


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_tied_weights_are_swapped_together_and_come_back_as_the_same_parameter():
    model, ids = Tied(), torch.tensor([1, 2])
    with computed_in(model, torch.float64):
        assert model(ids).dtype == torch.float64  # the head's weight too: it is the embedding's
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.dtype == torch.float32 and model.embed.weight.requires_grad
    plain = model(ids)
    with lora_weights(model, {"embed.weight": torch.zeros(5, 3)}):  # by name: only LoRA, and here none is
        assert torch.equal(model(ids), plain)
