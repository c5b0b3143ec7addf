"""A GRPO group is one policy: TRL's rollout loop asks for the adapter current when each request is sent,
so a sync between two samples of a group splits it across two adapter names; GroupPinnedRolloutLoop
(rl_cluster/trainer/compat.py, item 6) asks for the group's version for every sample. And TRL starts
groups as fast as slots free up; GroupPinnedRolloutLoop admits them under the trainer's limit (item 10).

The loops are TRL's real `_AsyncRolloutLoop` (and our subclass) on the tiny model's tokenizer; only the
HTTP post to the server is replaced, by a function that records the requested adapter and answers at
once: a pure test of the loop's request naming, no vLLM involved. One test keeps the loop's own post,
against two stub servers: where it sends its requests when the proxy moves."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import aiohttp
import pytest
from aiohttp import web
from conftest import free_port
from datasets import Dataset
from transformers import AutoTokenizer
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

from rl_cluster.core.rewards import arithmetic_reward
from rl_cluster.tiny import make_prompts
from rl_cluster.trainer.rollout import GroupPinnedRolloutLoop, TrainerPosition

G = 4


# Every queue a test's loop was given. Nobody reads most of what the loops put there, and a process whose
# queue holds more than a pipe's worth of unread data cannot exit (compat item 13): how much the score
# loop's per-group metrics reach depends on the machine's speed, so each test lets all of its queues go.
_QUEUES: list = []


@pytest.fixture(autouse=True)
def _let_queues_go():
    yield
    while _QUEUES:
        _QUEUES.pop().cancel_join_thread()


def rollout_loop(cls, tiny_model_dir, reward_funcs=(arithmetic_reward,), tokens=("7",), **extra):
    ctx = mp.get_context("spawn")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    queues = {name: ctx.Queue() for name in ("rollout_buffer", "exception_info_queue", "metrics_queue")}
    _QUEUES.extend(queues.values())
    loop = cls(
        model_name=str(tiny_model_dir), dataset=Dataset.from_list(make_prompts(8, seed=0)),
        reward_funcs=list(reward_funcs), processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id],
        model_version_value=ctx.Value("i", 1), heartbeat_value=ctx.Value("d", 0.0), failed_event=ctx.Event(),
        num_generations=G, lora_name="run", **queues, **extra,
    )  # fmt: skip
    asked: list[str] = []

    async def post(path, payload, timeout, max_retries=3):
        asked.append(payload["model"])
        # One of `tokens` per request in turn; "..." stands for a completion cut off at the length cap.
        text = tokens[(len(asked) - 1) % len(tokens)]
        ids = tokenizer.encode(text.strip("."), add_special_tokens=False)[:1]
        ids = ids * 2 if text.endswith("...") else [*ids, tokenizer.eos_token_id]
        return {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.1] * len(ids)}}]}

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
    assert loop._group_versions == {0: 1}  # until the group is scored
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


async def run_loops(loop, phases) -> list:
    """TRL's own generate and score loops, with nobody pulling from the rollout buffer; `phases` are
    (seconds, action) pairs, each action run after its wait. Returns the requests sent per phase."""
    from accelerate.state import PartialState

    PartialState()  # as TRL's child does before its loops log
    stop = asyncio.Event()
    tasks = [asyncio.create_task(loop._generate_loop(stop)), asyncio.create_task(loop._score_loop(stop))]
    sent = []
    for seconds, action in phases:
        await asyncio.sleep(seconds)
        sent.append(len(loop.asked))
        action()
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)  # waiting samples do not hold up the stop
    return sent


def test_trl_starts_groups_however_far_ahead_of_the_trainer(tiny_model_dir):
    loop, asked = rollout_loop(_AsyncRolloutLoop, tiny_model_dir, max_inflight_tasks=2 * G)
    loop.asked = asked
    sent = asyncio.run(run_loops(loop, [(1.0, lambda: None)]))
    assert sent[0] > 10 * G  # nobody consumes, and it keeps generating


def test_admission_starts_groups_only_under_the_trainers_limit(tiny_model_dir):
    ctx = mp.get_context("spawn")
    position = TrainerPosition(ctx, limit=3 * G)
    loop, asked = rollout_loop(
        GroupPinnedRolloutLoop, tiny_model_dir, pinned_window=2, position=position, max_inflight_tasks=2 * G
    )
    loop.asked = asked

    def sync():  # what BucketSyncTrainer does after a sync: the version first, then the limit
        loop._model_version_value.value = 2
        position[TrainerPosition.LIMIT] = 5 * G

    sent = asyncio.run(run_loops(loop, [(1.0, sync), (1.0, lambda: None)]))
    assert sent == [3 * G, 5 * G]
    assert asked == ["run-v1"] * (3 * G) + ["run-v2"] * (2 * G)
    assert position[TrainerPosition.SCORED] == 5
    # Scored groups carry the version they were generated under.
    versions = [loop.rollout_buffer.get(timeout=5).model_version for _ in range(5 * G)]
    assert versions == [1] * (3 * G) + [2] * (2 * G)


TRUNCATION_SEEN: list[list[bool]] = []


def record_truncation(completions, completion_ids, truncated=None, **kwargs):
    TRUNCATION_SEEN.append(list(zip(truncated, [ids[-1] for ids in completion_ids], strict=True)))
    return [0.0] * len(completions)


def test_reward_functions_learn_which_completions_were_cut_off(tiny_model_dir):
    """compat item 15: TRL passes no finish reason; the loop passes `truncated` by TRL's own rule."""
    TRUNCATION_SEEN.clear()
    loop, asked = rollout_loop(
        GroupPinnedRolloutLoop, tiny_model_dir, reward_funcs=[record_truncation], tokens=("7", "7..."),
        pinned_window=2, max_inflight_tasks=G,
    )  # fmt: skip
    loop.asked = asked
    asyncio.run(run_loops(loop, [(1.0, lambda: None)]))
    eos = loop.tokenizer.eos_token_id
    pairs = [pair for group in TRUNCATION_SEEN for pair in group]
    assert {truncated for truncated, _ in pairs} == {False, True}  # both kinds were generated
    assert all(truncated == (last != eos) for truncated, last in pairs), pairs


async def _stub(name: str, heard: list) -> tuple[web.AppRunner, str]:
    """A server that answers every completion with one token and records who heard it."""

    async def completions(request: web.Request) -> web.Response:
        heard.append(name)
        return web.json_response({"choices": [{"token_ids": [7], "logprobs": {"token_logprobs": [-0.1]}}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_the_loop_posts_where_the_position_says_the_proxy_is_from_its_next_try(tiny_model_dir):
    """Ray restarts a proxy whose node was lost on another node, at a new address; the trainer moves the
    position's URL (rl_cluster.trainer.rank's proxy follower), and the child's next try of a post goes
    there. Here the first try meets a closed port (the lost node) and the move comes during TRL's retry
    delay: the post succeeds at the new address. The loop's own URL serves while the position has none."""

    async def main() -> list:
        heard: list[str] = []
        first, first_url = await _stub("first", heard)
        moved, moved_url = await _stub("moved", heard)
        position = TrainerPosition(mp.get_context("spawn"), limit=8 * G)
        loop, _ = rollout_loop(GroupPinnedRolloutLoop, tiny_model_dir, pinned_window=2, position=position,
                               vllm_server_url=first_url)  # fmt: skip
        del loop._post  # the loop's own post, to the stubs
        body = {"model": "run-v1", "prompt": [1, 2], "max_tokens": 1}
        try:
            async with aiohttp.ClientSession() as loop.session:
                await loop._post("/v1/completions", body, timeout=10)
                position.follow_proxy(f"http://127.0.0.1:{free_port()}")  # nothing there: the lost node
                post = asyncio.ensure_future(loop._post("/v1/completions", body, timeout=10))
                await asyncio.sleep(0.3)  # the first try failed; TRL waits 1 s before the next
                position.follow_proxy(moved_url)
                await post
        finally:
            await first.cleanup()
            await moved.cleanup()
        assert loop._counters["rollout/vllm_retry_total"] >= 1  # the try at the lost address failed
        return heard

    assert asyncio.run(main()) == ["first", "moved"]
