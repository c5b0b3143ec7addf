"""A GRPO group is one policy: TRL's rollout loop asks for the adapter current when each request is sent,
so a sync between two samples of a group splits it across two adapter names; GroupPinnedRolloutLoop
(rl_cluster/trainer/compat.py, item 6) asks for the group's version for every sample.

The loops are TRL's real `_AsyncRolloutLoop` (and our subclass) on the tiny model's tokenizer; only the
HTTP post to the server is replaced, by a function that records the requested adapter and answers at
once: a pure test of the loop's request naming, no vLLM involved."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
from datasets import Dataset
from transformers import AutoTokenizer
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

from rl_cluster.core.rewards import arithmetic_reward
from rl_cluster.tiny import make_prompts
from rl_cluster.trainer.compat import GroupPinnedRolloutLoop

G = 4


def rollout_loop(cls, tiny_model_dir, **extra):
    ctx = mp.get_context("spawn")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    loop = cls(
        model_name=str(tiny_model_dir), dataset=Dataset.from_list(make_prompts(8, seed=0)),
        reward_funcs=[arithmetic_reward], processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id],
        rollout_buffer=ctx.Queue(), model_version_value=ctx.Value("i", 1), heartbeat_value=ctx.Value("d", 0.0),
        failed_event=ctx.Event(), exception_info_queue=ctx.Queue(), metrics_queue=ctx.Queue(),
        num_generations=G, lora_name="run", **extra,
    )  # fmt: skip
    asked: list[str] = []

    async def post(path, payload, timeout, max_retries=3):
        asked.append(payload["model"])
        token = tokenizer.encode("7", add_special_tokens=False)[0]
        return {
            "choices": [
                {"token_ids": [token, tokenizer.eos_token_id], "logprobs": {"token_logprobs": [-0.1, -0.2]}}
            ]
        }

    loop._post = post
    return loop, asked


async def one_group_across_a_sync(loop) -> None:
    """The generate loop's pattern when in-flight slots are scarce: two samples dispatched, then a sync
    (the trainer moves the shared version to 2), then the group's other samples as slots free up."""
    prompt = make_prompts(1, seed=1)[0]["prompt"]
    first = [
        asyncio.ensure_future(loop._generate_one(prompt, tool_dict={}, tools=[], group_id=0))
        for _ in range(2)
    ]
    await asyncio.gather(*first)
    loop._model_version_value.value = 2
    rest = [
        asyncio.ensure_future(loop._generate_one(prompt, tool_dict={}, tools=[], group_id=0))
        for _ in range(2)
    ]
    await asyncio.gather(*rest)


def test_trl_splits_a_group_across_adapters(tiny_model_dir):
    loop, asked = rollout_loop(_AsyncRolloutLoop, tiny_model_dir)
    asyncio.run(one_group_across_a_sync(loop))
    assert asked == ["run-v1", "run-v1", "run-v2", "run-v2"]


def test_pinned_loop_keeps_the_group_on_its_version(tiny_model_dir):
    loop, asked = rollout_loop(GroupPinnedRolloutLoop, tiny_model_dir, pinned_window=2)
    asyncio.run(one_group_across_a_sync(loop))
    assert asked == ["run-v1"] * G
    assert loop._group_versions == {}  # forgotten once all G samples were dispatched
    # The next group starts on the newest version.
    asked.clear()
    prompt = make_prompts(1, seed=2)[0]["prompt"]
    asyncio.run(loop._generate_one(prompt, tool_dict={}, tools=[], group_id=1))
    assert asked == ["run-v2"]


@pytest.mark.parametrize("window,expected", [(3, "run-v1"), (2, "run-v4")])
def test_a_group_older_than_the_window_asks_for_the_newest(tiny_model_dir, window, expected):
    """Its version may be unloaded already (it left the window); it is dropped as stale when scored."""
    loop, asked = rollout_loop(GroupPinnedRolloutLoop, tiny_model_dir, pinned_window=window)
    prompt = make_prompts(1, seed=3)[0]["prompt"]
    asyncio.run(loop._generate_one(prompt, tool_dict={}, tools=[], group_id=5))  # pinned to v1
    loop._model_version_value.value = 4
    asyncio.run(loop._generate_one(prompt, tool_dict={}, tools=[], group_id=5))
    assert asked == ["run-v1", expected]
