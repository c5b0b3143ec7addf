"""The toy task's reward functions: pure, TRL-shaped, 0-1 scale."""

import doctest

from rl_cluster.core import rewards
from rl_cluster.core.rewards import arithmetic_reward, completion_text, exact_match_reward


def msg(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_docstring_examples():
    assert doctest.testmod(rewards).failed == 0


def test_completion_text_accepts_messages_strings_and_dicts():
    assert completion_text(msg("7")) == "7"
    assert completion_text("7") == "7"
    assert completion_text({"role": "assistant", "content": "7"}) == "7"
    assert completion_text([]) == ""
    assert completion_text(msg(None)) == ""
    # The last assistant message counts (tool turns may come between).
    convo = [msg("1")[0], {"role": "tool", "content": "x"}, msg("2")[0]]
    assert completion_text(convo) == "2"


def test_arithmetic_reward_partial_credit():
    completions = [msg("12"), msg(" 12\n"), msg("13"), msg("22"), msg("1"), msg("120"), msg(""), msg("ab")]
    assert arithmetic_reward(completions, ["12"] * 8) == [1.0, 1.0, 0.5, 0.5, 0.5, 2 / 3, 0.0, 0.0]


def test_arithmetic_reward_single_digit_and_plain_strings():
    assert arithmetic_reward(["7", "8", "07", "7 "], ["7", "7", "7", "7"]) == [1.0, 0.0, 0.0, 1.0]


def test_rewards_stay_in_unit_interval_and_ignore_extra_columns():
    completions = [msg(t) for t in ["", "1", "18", "999999", "\n", "x1"]]
    for func in (arithmetic_reward, exact_match_reward):
        scores = func(
            completions, ["18"] * 6, prompts=[None] * 6, completion_ids=[[]] * 6, trainer_state=None
        )
        assert len(scores) == 6
        assert all(isinstance(s, float) and 0.0 <= s <= 1.0 for s in scores)


def test_exact_match_reward():
    assert exact_match_reward([msg("18"), msg("18 "), msg("81"), "18"], ["18"] * 4) == [1.0, 1.0, 0.0, 1.0]


def test_rewards_module_is_pure():
    import subprocess
    import sys

    code = (
        "import sys, rl_cluster.core.rewards\n"
        "heavy = {'torch', 'ray', 'vllm', 'transformers', 'aiohttp', 'requests', 'httpx'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
