"""Trainer.run: one train() per life of the trainer actor, however often the driver asks (it asks again
when its call failed, and in a network partition the life it asked goes on training)."""

from __future__ import annotations

import threading
import time

import pytest

from rl_cluster.trainer.actor import Trainer
from rl_cluster.trainer.once import Once


def a_trainer(train) -> Trainer:
    """A Trainer with only what run() uses (its constructor builds a bucket and Ray metrics)."""
    trainer = Trainer.__new__(Trainer)
    trainer._once = Once()
    trainer.train = train
    return trainer


def test_a_second_call_waits_for_the_first_training_and_gets_its_outcome():
    started, release, calls = threading.Event(), threading.Event(), []

    def train(resume: bool = False) -> dict:
        calls.append(resume)
        started.set()
        release.wait(10)
        return {"steps": 16}

    trainer = a_trainer(train)
    answers: list[dict] = []
    first = threading.Thread(target=lambda: answers.append(trainer.run(resume=True)))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: answers.append(trainer.run(resume=True)))
    second.start()
    time.sleep(0.2)
    assert answers == []  # the second waits for the training under way
    release.set()
    first.join(10)
    second.join(10)
    assert answers == [{"steps": 16}, {"steps": 16}] and calls == [True]  # trained once
    assert trainer.run() == {"steps": 16} and calls == [True]  # and never again in this life


def test_a_training_that_failed_fails_every_call():
    def train(resume: bool = False) -> dict:
        raise RuntimeError("bucket unreachable")

    trainer = a_trainer(train)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="bucket unreachable"):
            trainer.run()
