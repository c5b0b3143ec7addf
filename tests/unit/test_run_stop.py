"""The driver's end of a run (rl_cluster.run): a signal or the lease's loss cancels the run while it trains;
once the run is ending, one that comes then interrupts neither its summary nor its cleanup; a failed run's
summary names the error that ended it."""

from __future__ import annotations

import asyncio

from rl_cluster.run import RunStop, failure


def test_a_stop_cancels_the_run_while_it_trains_and_nothing_once_it_is_ending(capsys):
    async def run() -> bool:
        loop, stop = asyncio.get_running_loop(), RunStop(asyncio.current_task())
        loop.call_soon(stop)  # a signal while the run trains
        try:
            await loop.create_future()  # the training
            cancelled = False
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()
            cancelled = True
        stop.ending = True
        # A frozen driver thawed: its lease's loss arrives while the run summarises.
        loop.call_soon(stop)
        await asyncio.sleep(0.05)  # the summary's awaits
        return cancelled

    assert asyncio.run(run()) is True
    assert capsys.readouterr().out == "already stopping: summary first, then every process\n"


def test_a_failed_run_names_the_actors_error_not_rays_wrapper():
    """The summary's status line of a run whose trainer failed held the whole remote traceback."""
    from ray.exceptions import RayTaskError

    from rl_cluster.errors import TrainingFailed

    remote = 'Traceback (most recent call last):\n  File "actor.py", line 108, in train\n' * 4
    wrapped = RayTaskError(
        "Trainer.run", remote, TrainingFailed("LeaseLost: the trainer refuses")
    ).as_instanceof_cause()
    assert failure(wrapped) == "TrainingFailed: LeaseLost: the trainer refuses"
    assert failure(ValueError("no such column")) == "ValueError: no such column"
