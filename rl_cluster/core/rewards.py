"""Reward functions for the toy task, in TRL's form: `f(completions, answer, **kwargs) -> list[float]`.

Pure Python (no torch, Ray, vLLM or HTTP), scores on a 0-1 scale. `completions` is what TRL passes:
in conversational mode one message list per completion (`[{"role": "assistant", "content": "7"}]`);
plain strings are accepted too. `answer` is the dataset column of the same name, one per completion.
"""

from __future__ import annotations

from typing import Any


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is, or the content of the last assistant message.

    >>> completion_text([{"role": "assistant", "content": " 7 "}])
    ' 7 '
    >>> completion_text("12")
    '12'
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    for message in reversed(list(completion)):
        if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
            return str(message.get("content") or "")
    return ""


def _char_credit(text: str, answer: str) -> float:
    text, answer = text.strip(), str(answer).strip()
    if not text or not answer:
        return float(text == answer)
    hits = sum(a == b for a, b in zip(text, answer, strict=False))
    return hits / max(len(text), len(answer))


def arithmetic_reward(completions: list, answer: list, **kwargs: Any) -> list[float]:
    """Partial credit: the share of answer characters right in place (surrounding whitespace ignored),
    over the longer of completion and answer. Exact answer: 1.0; one digit of two wrong: 0.5.

    >>> arithmetic_reward([[{"role": "assistant", "content": "12"}], "13", "7", "120", ""], ["12"] * 5)
    [1.0, 0.5, 0.0, 0.6666666666666666, 0.0]
    """
    return [_char_credit(completion_text(c), a) for c, a in zip(completions, answer, strict=True)]


def exact_match_reward(completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion is exactly the answer (surrounding whitespace ignored), else 0.0.

    >>> exact_match_reward([[{"role": "assistant", "content": " 7"}], "8"], ["7", "7"])
    [1.0, 0.0]
    """
    return [
        float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)
    ]


def math_reward(completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion's final answer is mathematically equal to the reference (math-verify
    parses LaTeX and plain expressions, so `\\boxed{\\frac{1}{2}}` matches `0.5`), else 0.0. For the
    GPU reference recipe (Qwen2.5-Math on a math dataset).

    >>> math_reward([[{"role": "assistant", "content": "so the answer is $\\\\boxed{\\\\frac{1}{2}}$"}], "3"], ["0.5", "4"])
    [1.0, 0.0]
    """
    from math_verify import parse, verify  # a parser, not a heavy dependency; imported where used

    scores = []
    for c, a in zip(completions, answer, strict=True):
        gold, predicted = parse(str(a)), parse(completion_text(c))
        scores.append(float(bool(gold) and bool(predicted) and verify(gold, predicted)))
    return scores
