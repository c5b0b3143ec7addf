"""Reward functions in TRL's form: `f(completions, answer, **kwargs) -> list[float]`: the toy task's and
math (graded by rl_cluster.core.math_grading).

Pure Python (no torch, Ray, vLLM or HTTP), scores on a 0-1 scale. `completions` is what TRL passes:
in conversational mode one message list per completion (`[{"role": "assistant", "content": "7"}]`);
plain strings are accepted too. `answer` is the dataset column of the same name, one per completion.
"""

from __future__ import annotations

from typing import Any

from rl_cluster.core.math_grading import grade


def _last_assistant(completion: Any) -> dict | None:
    """The last assistant message of a completion (a string is one assistant message)."""
    if isinstance(completion, str):
        return {"role": "assistant", "content": completion}
    if isinstance(completion, dict):
        return completion
    for message in reversed(list(completion)):
        if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
            return message
    return None


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is, or the content of the last assistant message.

    >>> completion_text([{"role": "assistant", "content": " 7 "}])
    ' 7 '
    >>> completion_text("12")
    '12'
    """
    message = _last_assistant(completion)
    return str(message.get("content") or "") if message is not None else ""


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


def _scores(texts: list[str | None], answer: list, truncated: list[bool] | None) -> list[float]:
    cut = truncated if truncated is not None else [False] * len(texts)
    return [
        float(text is not None and not was_cut and grade(text, a))
        for text, a, was_cut in zip(texts, answer, cut, strict=True)
    ]


def math_reward(
    completions: list, answer: list, truncated: list[bool] | None = None, **kwargs: Any
) -> list[float]:
    r"""1.0 when the completion's last `\boxed{}` equals the reference answer (normalised, then
    math-verify for equivalent forms: rl_cluster.core.math_grading), else 0.0. No box: 0.0.

    `truncated`: one flag per completion, True where it was cut off at the length cap; those score 0.0
    whatever they boxed (a completion that never finished must not teach the policy to ramble). TRL does
    not pass it itself (its rollout worker passes `completion_ids`, whose last token is not EOS when cut):
    the caller adds it. Without it no completion counts as truncated.

    >>> math_reward([[{"role": "assistant", "content": "so $\\boxed{\\frac{1}{2}}$"}], "\\boxed{3}", "\\boxed{4}"],
    ...             ["0.5", "4", "4"], truncated=[False, False, True])
    [1.0, 0.0, 0.0]
    """
    return _scores([completion_text(c) for c in completions], answer, truncated)


def answer_after_thinking(completion: Any) -> str | None:
    r"""What a reasoning model answered after its `<think>` block: the text after the last `</think>`; None
    when the block never closed (a truncated or rambling completion has no answer).

    TRL parses a completion with the tokenizer's response template; for DeepSeek-R1-Distill that moves the
    thinking into `reasoning_content` (present only when `</think>` was emitted) and leaves the answer in
    `content`, so a message with a reasoning field has closed its block.

    >>> answer_after_thinking("<think>maybe \\boxed{2}</think> it is \\boxed{3}"), answer_after_thinking("<think>hmm")
    (' it is \\boxed{3}', None)
    >>> answer_after_thinking([{"role": "assistant", "reasoning_content": "hmm", "content": "\\boxed{3}"}])
    '\\boxed{3}'
    """
    message = _last_assistant(completion)
    if message is None:
        return None
    content = str(message.get("content") or "")
    if "</think>" in content:
        return content.rsplit("</think>", 1)[1]
    if any(message.get(key) is not None for key in ("reasoning_content", "reasoning", "thinking")):
        return content
    return None


def math_think_reward(
    completions: list, answer: list, truncated: list[bool] | None = None, **kwargs: Any
) -> list[float]:
    r"""`math_reward` for reasoning models: grades only what follows `</think>`, and 0.0 when the thinking
    block never closes (a box inside the thinking is not an answer).

    >>> math_think_reward(["<think>\\boxed{4}?</think>So \\boxed{4}.", "<think>\\boxed{4}", "\\boxed{4}"], ["4"] * 3)
    [1.0, 0.0, 0.0]
    """
    return _scores([answer_after_thinking(c) for c in completions], answer, truncated)
