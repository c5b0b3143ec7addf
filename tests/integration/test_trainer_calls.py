"""The driver's call of the trainer across the trainer's deaths (rl_cluster.trainer_calls.train_through_restarts), on
a real local Ray: a killed actor that Ray restarts is asked again and its new life answers; one that Ray
will not restart ends the call with Ray's error instead of waiting for ever. (The node-loss case, where
Ray's own retry of the call would be spent on the dead address, is the chaos run's, in
tests/e2e/test_multinode.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import ray

from rl_cluster.trainer_calls import train_through_restarts

pytestmark = pytest.mark.vllm  # the slow lane: it starts a Ray cluster


@ray.remote(max_restarts=1)
class Lives:
    """Stands in for the trainer actor: run() writes its pid, then trains (sleeps) until it is killed,
    unless it is a life Ray restarted."""

    def __init__(self, pid_file: str):
        self.pid_file = Path(pid_file)

    def run(self, resume: bool = False) -> dict:
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.pid_file.write_text(str(os.getpid()))
        if not restarted:
            time.sleep(600)
        return {"restarted": restarted, "resume": resume}


@pytest.fixture(scope="module")
def local_ray():
    # The state API needs the dashboard; a trainer's rank (a Ray Train worker) needs a `trainer` resource.
    ray.init(address="local", num_cpus=2, resources={"trainer": 1}, include_dashboard=True)
    yield
    ray.shutdown()


def kill_when_running(pid_file: Path) -> None:
    deadline = time.monotonic() + 60
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the actor never ran"
        time.sleep(0.1)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    pid_file.unlink()


async def test_a_killed_trainer_is_asked_again_and_its_restarted_life_answers(local_ray, tmp_path):
    pid_file = tmp_path / "pid"
    actor = Lives.remote(str(pid_file))
    call = asyncio.create_task(train_through_restarts(actor, resume=True))
    await asyncio.to_thread(kill_when_running, pid_file)
    assert await asyncio.wait_for(call, 120) == {"restarted": True, "resume": True}


async def test_a_trainer_ray_will_not_restart_ends_the_call_with_rays_error(local_ray, tmp_path):
    pid_file = tmp_path / "pid"
    actor = Lives.options(max_restarts=0).remote(str(pid_file))
    call = asyncio.create_task(train_through_restarts(actor, resume=False))
    await asyncio.to_thread(kill_when_running, pid_file)
    with pytest.raises(ray.exceptions.RayActorError):
        await asyncio.wait_for(call, 120)


async def test_a_new_trainer_actor_starts_its_rank_which_imports_its_training_stack_before_it_is_asked_to_train(
    local_ray, tmp_path
):
    """The run makes the trainer actor while the generators start and asks it to train once they serve: Ray
    Train starts its rank (a process of its own, on a node with the `trainer` resource) at once, and the rank
    imports TRL, PEFT and torch in that time, not after it; the actor says where the rank runs."""
    from conftest import tiny_run_config

    from rl_cluster.credentials import RunSecrets
    from rl_cluster.trainer.rank import TRAINING_STACK
    from rl_cluster.trainer_calls import trainer_actor

    def imported(trainer) -> tuple[list[str], int]:  # in the actor (travels by value)
        import os

        return list(trainer.imported), os.getpid()

    config = tiny_run_config("warm", tmp_path / "no-model-needed", tmp_path)
    trainer = trainer_actor(config, None, RunSecrets())  # trains on no proxy
    try:
        where = await asyncio.wait_for(trainer.placement.remote(), 300)
        deadline = time.monotonic() + 300
        while (held := await trainer.__ray_call__.remote(imported))[0] != list(TRAINING_STACK):
            assert time.monotonic() < deadline, held
            await asyncio.sleep(1)
        assert where["pid"] != held[1] and where["address"] and where["node_id"]  # the rank's own process
        assert (await trainer.report.remote())["history"] == []  # nothing trained: run() was never asked
    finally:
        ray.kill(trainer)


async def test_the_driver_is_answered_while_run_and_a_run_asked_again_hold_the_trainer(local_ray, tmp_path):
    """After a partition the driver asks run() again, and that call waits for the first training: two
    threads held for the whole run. report(), stop(), placement() and the lease's news must still answer
    (with two threads in all, stop() never arrived and the lease's news would close the write fence)."""
    from conftest import tiny_run_config

    from rl_cluster.trainer.actor import trainer_actor_class

    def _hold(trainer, started: str) -> None:  # in the actor (travels by value), a thread of run()'s group
        import time

        with open(started, "a") as f:
            f.write("x")
        time.sleep(600)

    config = tiny_run_config("held", tmp_path / "no-model-needed", tmp_path)
    trainer = trainer_actor_class().options(num_cpus=0).remote(config, None)  # trains on no proxy
    started = tmp_path / "started"
    try:
        held = [trainer.__ray_call__.remote(_hold, str(started)) for _ in range(2)]
        deadline = time.monotonic() + 120
        while not (started.exists() and started.read_text() == "xx"):
            assert time.monotonic() < deadline, "the two holding calls never both ran"
            await asyncio.sleep(0.2)
        assert (await asyncio.wait_for(trainer.report.remote(), 30))["history"] == []
        await asyncio.wait_for(trainer.lease_news.remote(valid_for_s=60.0), 30)
        assert (await asyncio.wait_for(trainer.stop.remote(), 30))["checkpoints"] == []
        assert "address" in await asyncio.wait_for(trainer.placement.remote(), 300)  # where its rank runs
        assert len(held) == 2
    finally:
        ray.kill(trainer)


async def test_an_error_of_the_training_fails_the_run_once_and_is_no_reason_to_restart_the_gang(
    local_ray, tmp_path
):
    """Ray Train restarts a gang whose rank raised, as it does one whose rank died; but an error the
    training raises (here: model.path is no directory on the rank's node) would be raised again by every
    restart. The rank reports it instead, and run() fails with it at once: TrainingFailed, no restart."""
    from conftest import tiny_run_config

    from rl_cluster.credentials import RunSecrets
    from rl_cluster.errors import TrainingFailed
    from rl_cluster.trainer_calls import trainer_actor

    config = tiny_run_config("broken", tmp_path / "no-model-here", tmp_path)
    trainer = trainer_actor(config, None, RunSecrets())  # trains on no proxy
    try:
        await asyncio.wait_for(trainer.lease_news.remote(valid_for_s=60.0), 30)
        with pytest.raises(ray.exceptions.RayTaskError) as failed:
            await asyncio.wait_for(trainer.run.remote(), 300)
        assert isinstance(failed.value.cause, TrainingFailed), failed.value
        assert "FileNotFoundError: model.path=" in str(failed.value.cause) and "no-model-here" in str(
            failed.value
        )
        report = await asyncio.wait_for(trainer.report.remote(), 30)
        assert report["trainer_restarts"] == 0 and len(report["ranks"]) == 1, report
    finally:
        ray.kill(trainer)


async def test_the_proxy_says_where_it_serves_once_it_does_and_again_once_restored(local_ray):
    """What the trainer follows: the proxy actor's address() is None until it serves; a proxy Ray restarted
    (here its process SIGKILLed; on a lost node, on another `proxy` node at a new address) says None until
    the pool controller restored it, and the rank's proxy_address waits for that (bounded)."""
    import urllib.parse

    from rl_cluster.config import ProxyConfig
    from rl_cluster.proxy.actor import ProxyActor
    from rl_cluster.trainer.rank import proxy_address

    def pid(proxy) -> int:  # in the actor (travels by value)
        import os

        return os.getpid()

    proxy = ProxyActor.options(num_cpus=0, max_restarts=1, max_task_retries=-1).remote(ProxyConfig())
    try:
        assert await asyncio.wait_for(proxy.address.remote(), 60) is None  # not started
        url = await asyncio.wait_for(proxy.start.remote(), 60)
        assert await proxy.address.remote() == url
        os.kill(await proxy.__ray_call__.remote(pid), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not await asyncio.wait_for(proxy.awaiting_restore.remote(), 60):  # Ray restarted it
            assert time.monotonic() < deadline
            await asyncio.sleep(0.5)
        assert await proxy.address.remote() is None
        waiting = asyncio.ensure_future(asyncio.to_thread(proxy_address, proxy, 60.0))
        await asyncio.sleep(2.0)
        assert not waiting.done()  # a rank starting now waits for the restore
        # Asked twice at once (a pool controller's call that Ray retried across the controller's restart
        # once ran beside its successor's): one restore binds, the other finds it serving.
        port = urllib.parse.urlsplit(url).port
        twice = asyncio.gather(proxy.restore.remote(port, {}), proxy.restore.remote(port, {}))
        assert await asyncio.wait_for(twice, 60) == [url, url]
        assert await asyncio.wait_for(waiting, 30) == url
        assert await proxy.address.remote() == url
    finally:
        ray.kill(proxy)
