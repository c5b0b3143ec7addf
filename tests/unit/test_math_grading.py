"""Math grading as the MATH recipes use it: last box, normalisation, math-verify fallback, truncation,
and the `<think>` variant. Reference answers are spelled the way MATH's solutions box them."""

import doctest
import subprocess
import sys
import threading

import pytest

from rl_cluster.core import math_grading
from rl_cluster.core.math_grading import answers_match, grade, last_boxed, normalize
from rl_cluster.core.rewards import answer_after_thinking, math_reward, math_think_reward

# (completion, reference answer, expected score)
CASES = [
    # --- exact and trivially equal
    (r"Adding, $2+3=\boxed{5}$.", "5", 1.0),
    (r"The sum is $\boxed{ 5 }$.", "5", 1.0),
    (r"So the answer is $\boxed 5$.", "5", 1.0),
    (r"Final: \fbox{42}", "42", 1.0),
    (r"$\boxed{-7}$", "-7", 1.0),
    # --- fractions: \dfrac, \tfrac, \frac12, a/b, decimals
    (r"$\boxed{\frac{1}{2}}$", r"\dfrac{1}{2}", 1.0),
    (r"$\boxed{\tfrac{3}{4}}$", r"\frac34", 1.0),
    (r"$\boxed{0.5}$", r"\frac{1}{2}", 1.0),
    (r"$\boxed{1/2}$", r"\frac{1}{2}", 1.0),
    (r"$\boxed{-\frac{2}{3}}$", r"-\dfrac{2}{3}", 1.0),
    (r"$\boxed{\frac{-2}{3}}$", r"-\frac{2}{3}", 1.0),
    (r"$\boxed{.25}$", r"\frac{1}{4}", 1.0),
    (r"$\boxed{2.50}$", "2.5", 1.0),
    (r"$\boxed{\frac{10}{4}}$", r"\frac{5}{2}", 1.0),
    # --- nested braces
    (r"$\boxed{\frac{\sqrt{3}}{2}}$", r"\frac{\sqrt{3}}{2}", 1.0),
    (r"$\boxed{\frac{\sqrt3}{2}}$", r"\frac{\sqrt{3}}{2}", 1.0),
    (r"$\boxed{2\sqrt{2}}$", r"2\sqrt2", 1.0),
    (r"$\boxed{\left( 3, \frac{\pi}{2} \right)}$", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    # --- units, degrees, money, percent, text
    (r"The side is $\boxed{5\text{ cm}}$.", "5", 1.0),
    (r"$\boxed{12}$ square units.", r"12\text{ square units}", 1.0),
    (r"The area is $\boxed{24 \text{ cm}^2}$.", "24", 1.0),
    (r"$\boxed{30^\circ}$", "30", 1.0),
    (r"$\boxed{90^{\circ}}$", r"90^\circ", 1.0),
    (r"$\boxed{\$18.90}$", r"\$18.90", 1.0),
    (r"$\boxed{18.9}$", r"\$18.90", 1.0),
    (r"$\boxed{25\%}$", r"25\%", 1.0),
    (r"It takes $\boxed{6}$ hours.", r"6\mbox{ hours}", 1.0),
    (r"$\boxed{\text{(C)}}$", r"\text{(C)}", 1.0),
    (r"$\boxed{C}$", r"\text{(C)}", 1.0),
    (r"$\boxed{\text{Evelyn}}$", r"\text{Evelyn}", 1.0),
    # --- formatting: spaces, thousands, punctuation, leading variable
    (r"$\boxed{1,\!000}$", "1000", 1.0),
    (r"$\boxed{10{,}000}$", "10000", 1.0),
    (r"$\boxed{1000.}$", "1000", 1.0),
    (r"$\boxed{x = 3}$", "3", 1.0),
    (r"$\boxed{k=-\frac{1}{4}}$", r"-\frac14", 1.0),
    (r"$\boxed{\displaystyle \frac{7}{9}}$", r"\frac{7}{9}", 1.0),
    (r"Intervals: $\boxed{(-\infty, 3]}$", r"(-\infty,3]", 1.0),
    (r"$\boxed{x^{2}+1}$", "x^2+1", 1.0),
    # --- equivalent forms only math-verify sees
    (r"$\boxed{\sqrt{2}/2}$", r"\frac{\sqrt{2}}{2}", 1.0),
    (r"$\boxed{\frac{\pi}{2}}$", r"\pi/2", 1.0),
    (r"$\boxed{\{3, 1, 2\}}$", r"\{1,2,3\}", 1.0),
    (r"$\boxed{\sqrt{12}}$", r"2\sqrt{3}", 1.0),
    (r"$\boxed{y^2+x^2}$", "x^2+y^2", 1.0),
    # --- the last box is the answer
    (r"First $\boxed{4}$, but correcting: $\boxed{5}$.", "5", 1.0),
    (r"First $\boxed{5}$, but correcting: $\boxed{4}$.", "5", 0.0),
    # --- must score 0
    (r"$\boxed{6}$", "5", 0.0),
    ("The answer is 5.", "5", 0.0),  # no box
    (r"So the answer is $\boxed{5", "5", 0.0),  # a box that never closes (cut off)
    (r"$\boxed{}$", "5", 0.0),
    (r"$\boxed{5}$", "-5", 0.0),
    (r"$\boxed{0.33}$", r"\frac{1}{3}", 0.0),  # close is not equal
    (r"$\boxed{\frac{1}{3}}$", r"\frac{1}{2}", 0.0),
    (r"$\boxed{[1,2]}$", "[1,2)", 0.0),
    (r"$\boxed{(2,1)}$", "(1,2)", 0.0),
    (r"$\boxed{50}$", r"5\text{ cm}", 0.0),
    (r"$\boxed{\sqrt{2}}$", "2", 0.0),
    (r"$\boxed{2\pi}$", "2", 0.0),
    (r"$\boxed{\text{(B)}}$", r"\text{(C)}", 0.0),
    (r"$\boxed{x=-3}$", "3", 0.0),
    (r"$\boxed{100}$", "1000", 0.0),
    (r"$\boxed{2^{10^{10}}}$", r"2^{10^{11}}", 0.0),  # a tower: never handed to sympy
]


@pytest.mark.parametrize("completion,reference,expected", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_math_cases(completion, reference, expected):
    assert math_reward([[{"role": "assistant", "content": completion}]], [reference]) == [expected]


def test_the_table_is_big_and_has_zeros():
    assert len(CASES) >= 40
    assert sum(e == 0.0 for _, _, e in CASES) >= 15


def test_docstring_examples():
    assert doctest.testmod(math_grading).failed == 0


@pytest.mark.parametrize(
    "text,boxed",
    [
        (r"\boxed{a{b{c}}d}", "a{b{c}}d"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not close the box
        (r"\boxed{\frac{1}{2}} and \fbox{3}", "3"),
        (r"\boxed 7.", "7."),
        (r"\boxed", None),
        (r"\boxed{", None),
        (r"\boxed{1}\boxed{2", None),  # the last box decides, even when it is broken
        (r"\boxeddots", None),  # not the \boxed command
        ("", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


def test_normalize_leaves_commands_that_only_start_like_left_and_right():
    assert normalize(r"\rightarrow") == r"\rightarrow"
    assert normalize(r"\left[ 1, 2 \right)") == "[1,2)"


def test_reference_may_be_a_whole_solution():
    solution = r"We have $x + 1 = 3$, so $x = \boxed{2}$."
    assert grade(r"thus $\boxed{2}$", solution)
    assert not grade(r"thus $\boxed{3}$", solution)


def test_truncated_completions_score_zero_even_when_right():
    completions = [r"$\boxed{5}$"] * 3
    assert math_reward(completions, ["5"] * 3, truncated=[False, True, False]) == [1.0, 0.0, 1.0]
    assert math_reward(completions, ["5"] * 3) == [1.0] * 3  # no flags: nothing counts as cut off
    with pytest.raises(ValueError):  # one flag per completion
        math_reward(completions, ["5"] * 3, truncated=[False])


def test_rewards_ignore_trl_extra_kwargs_and_stay_floats():
    scores = math_reward(
        [r"$\boxed{5}$", "x"], ["5", "5"], prompts=[None] * 2, completion_ids=[[1, 2], [3]], level=["1", "2"]
    )
    assert scores == [1.0, 0.0] and all(type(s) is float for s in scores)


def test_math_verify_fallback_is_guarded_and_works_off_the_main_thread():
    # TRL scores in a worker thread, where math-verify's SIGALRM timeouts would raise: the fallback must
    # still decide equivalent forms there.
    results = {}
    thread = threading.Thread(
        target=lambda: results.update(
            same=answers_match(r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}"), differ=answers_match(r"\sqrt{3}/2", "1")
        )
    )
    thread.start()
    thread.join(timeout=60)
    assert results == {"same": True, "differ": False}


def test_math_verify_failure_counts_as_not_equal(monkeypatch):
    import math_verify

    def broken(*args, **kwargs):
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr(math_verify, "parse", broken)
    math_grading._math_verify_equal.cache_clear()  # results are cached per (answer, reference)
    try:
        assert not answers_match(r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}")  # needs the fallback, which failed
        assert answers_match("0.5", r"\frac{1}{2}")  # decided before the fallback
    finally:
        math_grading._math_verify_equal.cache_clear()


THINK = [
    (r"<think>It is 4? Let me check: $\boxed{4}$.</think>The answer is $\boxed{4}$.", 1.0),
    (r"<think>The answer is $\boxed{4}$.", 0.0),  # never closed: cut off while thinking
    (r"$\boxed{4}$", 0.0),  # no thinking block at all
    (r"<think>$\boxed{4}$</think>So it is four.", 0.0),  # boxed only inside the thinking
    (r"<think>a</think>first</think>then $\boxed{4}$", 1.0),  # the last </think> counts
    (r"<think>hmm</think>$\boxed{5}$", 0.0),
]


@pytest.mark.parametrize("completion,expected", THINK)
def test_think_variant_grades_only_after_the_block(completion, expected):
    assert math_think_reward([completion], ["4"]) == [expected]
    assert math_think_reward([[{"role": "assistant", "content": completion}]], ["4"]) == [expected]


def test_think_variant_reads_trls_parsed_reasoning_messages():
    # TRL's response parser for DeepSeek-R1-Distill puts the thinking in `reasoning_content` when `</think>`
    # was emitted (the prompt ends with `<think>\n`, so the completion never opens the block itself).
    closed = [{"role": "assistant", "reasoning_content": r"maybe \boxed{3}", "content": r"$\boxed{4}$"}]
    unclosed = [{"role": "assistant", "content": r"maybe ... so $\boxed{4}$"}]
    assert math_think_reward([closed, unclosed], ["4", "4"]) == [1.0, 0.0]
    assert math_think_reward([closed], ["4"], truncated=[True]) == [0.0]
    assert answer_after_thinking([]) is None


def test_grading_module_is_pure():
    code = (
        "import sys, rl_cluster.core.math_grading, rl_cluster.core.rewards\n"
        "heavy = {'torch', 'ray', 'vllm', 'transformers', 'aiohttp', 'requests', 'httpx', 'sympy',"
        " 'math_verify'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "predicted", [r"9^9^9", r"9^{9}^{9}", r"10^{10}!", r"2^{3^{4}}", r"2^{100000}", "1234!"]
)
def test_towers_and_factorials_of_powers_are_never_handed_to_sympy(predicted, monkeypatch):
    """sympy expands them for minutes, and off the main thread nothing can interrupt it: they are not
    shown equal, without math-verify ever being asked."""
    import math_verify

    def asked(*args, **kwargs):
        raise AssertionError(f"math-verify was asked about {predicted!r}")

    monkeypatch.setattr(math_verify, "parse", asked)
    assert not answers_match(predicted, r"9^{9^{9}}")


@pytest.mark.parametrize("predicted,reference", [(r"2^{10}", "1024"), (r"x^2+1", r"1+x^2")])
def test_plain_powers_still_reach_math_verify(predicted, reference):
    assert answers_match(predicted, reference)
