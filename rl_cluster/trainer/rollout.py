"""The rollout child's loop: TRL's `_AsyncRolloutLoop`, with each group generated under one adapter version
and admitted only when the trainer will consume it in time.

TRL's AsyncRolloutWorker spawns a child process that runs the loop; `pin_group_versions` makes it run
`GroupPinnedRolloutLoop` with the counters the trainer shares with it (`TrainerPosition`). The loop's
overrides of TRL's private methods are compat items (rl_cluster/trainer/compat.py's list): 6 (a group's
samples pinned to its version), 10 (admission), 12 (the position's pickling), 13 (the buffer let go on
stop), 14 (the child ends with its parent), 15 (`truncated` for reward functions), 19 (the bearer
header). What is ours is the admission rule itself (rl_cluster.core.admission) and the position.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import multiprocessing
import multiprocessing.context
import os
import threading

import aiohttp
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

from rl_cluster.core.admission import admits
from rl_cluster.core.auth import bearer_headers
from rl_cluster.trainer.rollout_server import rollout_context

# The version the group of the sample being generated runs under (set per sample's asyncio task).
_GROUP_VERSION: contextvars.ContextVar[int | None] = contextvars.ContextVar("group_version", default=None)
ADMISSION_POLL_S = 0.02


class TrainerPosition:
    """What the trainer and its rollout child share (items 10, 12), each written by one side only:
    samples the trainer pulled, the admission limit it sets at each sync (both trainer), groups the child
    scored or saw fail (child), and where the proxy serves (trainer: it follows a proxy Ray moved, and
    the child sends its requests there)."""

    PULLED, LIMIT, SCORED, FAILED = range(4)
    URL_BYTES = 512

    def __init__(self, ctx, limit: int, proxy_url: str = ""):
        self._values = ctx.Array("q", 4, lock=False)  # one writer per slot: no lock needed
        self._values[self.LIMIT] = limit
        # Locked: a URL is many bytes, and the child must not read one half written.
        self._url = ctx.Array("c", self.URL_BYTES)
        self.follow_proxy(proxy_url)

    @classmethod
    def _attached(cls, values, url) -> TrainerPosition:
        position = cls.__new__(cls)
        position._values, position._url = values, url
        return position

    def __reduce__(self):
        if multiprocessing.context.get_spawning_popen() is None:
            return (_PicklabilityProbe, ())  # TRL's early pickle check (item 12)
        return (TrainerPosition._attached, (self._values, self._url))

    @property
    def proxy_url(self) -> str:
        """Where the proxy serves, as the trainer last heard it ("": the loop's own URL)."""
        with self._url.get_lock():
            return self._url.value.decode()

    def follow_proxy(self, url: str) -> None:
        """The proxy serves at `url` now (a ProxyAddress follower)."""
        encoded = url.encode()
        if len(encoded) >= self.URL_BYTES:
            raise ValueError(f"a proxy URL of {len(encoded)} bytes: at most {self.URL_BYTES - 1}")
        with self._url.get_lock():
            self._url.value = encoded

    def __getitem__(self, slot: int) -> int:
        return self._values[slot]

    def __setitem__(self, slot: int, value: int) -> None:
        self._values[slot] = value

    def add(self, slot: int, n: int = 1) -> None:
        self._values[slot] += n


def exit_with_parent() -> None:
    """In a multiprocessing child: exit at once when the parent process dies (item 14)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return  # not a multiprocessing child (a test constructing the loop in-process)

    def watch() -> None:
        parent.join()  # returns when the parent's sentinel closes: it exited or was killed
        os._exit(1)

    threading.Thread(target=watch, name="rl-cluster-parent-watch", daemon=True).start()


class _Stopped(Exception):
    """The rollout loop is stopping while a sample waits for admission."""


class _PicklabilityProbe:
    """What TRL's early pickle check of the loop kwargs sees in place of a TrainerPosition."""


class GroupPinnedRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop, with every sample of a group generated under the group's version (item 6), and
    groups admitted only when the trainer will consume them in time (item 10).

    `pinned_window`: how many versions back a pinned group may ask for. An older group is dropped as
    stale when scored, and its adapter may be unloaded already (the trainer unloads versions that left
    the window), so its remaining samples ask for the newest version instead of failing.
    `position`: the counters shared with the trainer; None admits every group at once (TRL's behaviour).
    `auth_token`: sent as a bearer token with every post (item 19); None sends none.
    """

    def __init__(self, *args, pinned_window: int, position: TrainerPosition | None = None,
                 auth_token: str | None = None, **kwargs):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.pinned_window = pinned_window
        self.position = position
        self.auth_headers = bearer_headers(auth_token)
        self._group_versions: dict[int, int] = {}  # group id -> version, from admission until scored
        self._admitted_samples = 0
        self._admission_lock: asyncio.Lock | None = None
        self._failed_groups: set[int] = set()
        self._stopping: asyncio.Event | None = None
        exit_with_parent()  # item 14; the loop is constructed in the child

    async def _generate_loop(self, stop_event: asyncio.Event) -> None:
        # A sample waiting at admission never finishes by itself, and TRL's loop returns only once its
        # in-flight samples did: on stop they raise _Stopped, which ends the loop through its own cleanup.
        self._stopping = stop_event
        try:
            with contextlib.suppress(_Stopped):
                await super()._generate_loop(stop_event)
        finally:
            if stop_event.is_set():
                self.rollout_buffer.cancel_join_thread()  # item 13: nobody reads what is left

    def _generate_one(self, prompt, tool_dict, tools, group_id: int = 0):
        return self._generate_in_group(group_id, prompt, tool_dict=tool_dict, tools=tools)

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        # TRL's _post, with the bearer header (item 19); TRL's session carries no default headers. Its
        # retries stay TRL's `_retry` (not rl_cluster.core.retry): the loop's other calls go through it too,
        # and it counts them in rollout/vllm_retry_total.
        client_timeout = aiohttp.ClientTimeout(total=timeout)

        async def _do_post():
            # Each try asks where the proxy is: the trainer moves it when Ray restarted the proxy elsewhere.
            base = (self.position.proxy_url if self.position is not None else "") or self.vllm_server_url
            async with self.session.post(
                f"{base}{path}", json=payload, timeout=client_timeout, headers=self.auth_headers
            ) as r:
                r.raise_for_status()
                return await r.json() or {}

        return await self._retry(_do_post, label=f"POST {path}", max_attempts=max_retries)

    async def _generate_in_group(self, group_id: int, *args, **kwargs):
        version = self._group_versions.get(group_id)
        if version is None:
            version = await self._admit(group_id)
        _GROUP_VERSION.set(version)  # this sample's task has its own context
        try:
            return await super()._generate_one(*args, group_id=group_id, **kwargs)
        except Exception:
            if self.position is not None and group_id not in self._failed_groups:
                self._failed_groups.add(group_id)
                self.position.add(TrainerPosition.FAILED)
            raise

    async def _admit(self, group_id: int) -> int:
        """Wait until the group fits under the trainer's limit; its version is the one current then.
        Groups are admitted in the order their first samples arrive (asyncio.Lock is fair)."""
        if self._admission_lock is None:
            self._admission_lock = asyncio.Lock()
        async with self._admission_lock:
            if group_id not in self._group_versions:
                if self.position is not None:
                    limit = TrainerPosition.LIMIT
                    while not admits(self._admitted_samples, self.num_generations, self.position[limit]):
                        if self._stopping is not None and self._stopping.is_set():
                            raise _Stopped
                        await asyncio.sleep(ADMISSION_POLL_S)
                    self._admitted_samples += self.num_generations
                self._group_versions[group_id] = self.model_version
        return self._group_versions[group_id]

    async def _score_group(self, group):
        # Staleness counts from the version the group was generated under, not the one current when its first
        # sample took an in-flight slot (it may have waited for admission across a sync).
        group.model_version = self._group_versions.pop(group.group_id, group.model_version)
        ends = (*self.eos_token_ids, self.tokenizer.pad_token_id)
        group.reward_kwargs["truncated"] = [
            not ids or ids[-1] not in ends for ids in group.completions_ids
        ]  # item 15
        samples = await super()._score_group(group)
        if self.position is not None:
            self.position.add(TrainerPosition.SCORED)
        return samples

    @property
    def _request_model(self) -> str:
        pinned = _GROUP_VERSION.get()
        if self.lora_name is None or pinned is None or self.model_version - pinned > self.pinned_window:
            return super()._request_model
        return f"{self.lora_name}-v{pinned}"


def pin_group_versions(
    trainer, window: int, position: TrainerPosition | None = None, auth_token: str | None = None
) -> None:
    """Generate each group under one adapter version (item 6), admitted against `position` (item 10),
    posting with `auth_token` (item 19); before train(), which spawns the loop."""
    worker = trainer.rollout_worker
    if worker._loop_cls is not _AsyncRolloutLoop:
        raise RuntimeError(f"pin_group_versions would replace a custom rollout loop {worker._loop_cls!r}")
    worker._loop_cls = GroupPinnedRolloutLoop
    worker._mp_ctx = rollout_context()  # item 23; its queues, from TRL's spawn context, pass to it alike
    worker._loop_kwargs["pinned_window"] = window
    worker._loop_kwargs["position"] = position
    worker._loop_kwargs["auth_token"] = auth_token
