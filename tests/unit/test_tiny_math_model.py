"""The tiny model's MATH-format variant: what it is taught, and how `model.path = "tiny-math"` finds it.
(That the warm start leaves pass@1 below 1 and RL raises it is tests/e2e/test_math_run.py.)"""

from __future__ import annotations

import pytest

from rl_cluster import models, tiny
from rl_cluster.core.rewards import math_reward
from rl_cluster.data.tiny_math import all_problems


def test_math_completions_are_a_graded_and_an_ungraded_answer():
    rows = {r["problem"]: r for r in all_problems("+")}
    boxed, plain, answer = tiny.math_completions(rows["What is $9+8$?"])
    assert (boxed, plain, answer) == ("$9+8=\\boxed{17}$", "$9+8=17$", "17")
    for row in rows.values():
        boxed, plain, answer = tiny.math_completions(row)
        assert math_reward([boxed, plain], [answer, answer]) == [1.0, 0.0]


def test_the_box_choice_is_an_open_question_for_greedy_decoding():
    ws = tiny.MATH_RECIPE["warm_start"]
    # One side of 0.5 each: greedy boxes only the `box_high` problems, so pass@1 starts well below 1.
    assert ws["box_low"] < 0.5 < ws["box_high"] < 1
    assert tiny.MATH_RECIPE["base"]["model"] == tiny.RECIPE["model"]  # same architecture and tokenizer
    assert tiny._math_fingerprint() != tiny._fingerprint()


def test_tiny_math_resolves_to_its_own_model(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(tiny, "ensure_tiny_model", lambda task="add": asked.append(task) or tmp_path)
    assert models.resolve_model("tiny-math") == models.resolve_model("tiny") == tmp_path
    assert asked == ["math", "add"]


def test_an_unknown_tiny_task_is_refused(tmp_path):
    with pytest.raises(ValueError, match="`add` or `math`"):
        tiny.ensure_tiny_model(tmp_path, task="sub")
    assert not any(tmp_path.iterdir())  # nothing half-built left behind
