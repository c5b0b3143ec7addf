"""The driver's side of the trainer actor: made on a node with the `trainer` resource, asked to train
through its restarts, told the run lease's news (its write fence), and how often Ray restarted it."""

from __future__ import annotations

import asyncio
import time

from rl_cluster.config import RunConfig

# How long the trainer may stay unreachable before the run gives up on it: Ray declares a silent node dead
# after five missed health checks (up to ~65 s), then restarts the actor elsewhere.
TRAINER_LOST_S = 240.0
ASK_AGAIN_S = 5.0


async def train_through_restarts(trainer, resume: bool) -> dict:
    """The trainer's run(), asked again when the call failed because its actor died or could not be reached
    (its process killed, its node lost or cut off): a life Ray restarted resumes from the newest
    checkpoint, and a life that went on answers with the outcome of its training. Ray's own retry of the
    call is off: when a node is lost, Ray sends the retry to the dead address before it has noticed the
    death, and the retry is spent there (ActorUnavailableError). Bounded: Ray restarts the actor at most
    trainer.max_restarts times (then it is DEAD), and one unreachable for TRAINER_LOST_S ends the run."""
    import ray

    failing_since, last = None, None
    while True:
        asked = time.monotonic()
        try:
            return await trainer.run.options(max_task_retries=0).remote(resume=resume)
        except ray.exceptions.RayActorError as e:
            now = time.monotonic()
            if failing_since is None or now - asked > 2 * ASK_AGAIN_S:  # it had been answering meanwhile
                failing_since = now
            state = await asyncio.to_thread(actor_state, trainer)
            # A call to an actor that Ray restarts waits for its new life; one to an actor Ray will not
            # restart fails at once, every time (also when the state API is too slow to say DEAD).
            died_again = isinstance(e, ray.exceptions.ActorDiedError) and isinstance(
                last, ray.exceptions.ActorDiedError
            )
            if (
                state == "DEAD"
                or (died_again and now - asked < ASK_AGAIN_S)
                or now - failing_since > TRAINER_LOST_S
            ):
                raise
            last = e
            print(f"trainer unreachable ({type(e).__name__}; Ray says {state}): asking again", flush=True)
            await asyncio.sleep(ASK_AGAIN_S)


def _state_record(actor):
    """Ray's state API record of `actor`, asked of the cluster this driver joined: with no address the API
    refuses when the machine runs more than one Ray ("Found multiple active Ray instances")."""
    import ray
    from ray.util.state import get_actor

    return get_actor(actor._actor_id.hex(), address=ray.get_runtime_context().gcs_address)


def actor_state(actor) -> str | None:
    """ALIVE, RESTARTING, DEAD, ... from Ray's state API; None when it cannot tell."""
    try:
        state = _state_record(actor)
    except Exception:
        return None
    return None if state is None else str(state.state)


def trainer_actor(config: RunConfig, proxy, secrets):
    """The run's trainer actor, the coordinator of its ranks (rl_cluster.trainer.actor), on the driver's
    node; it takes no `trainer` resource (its ranks do, placed by Ray Train). `proxy`: the run's proxy
    actor: a handle, not its URL, which changes when Ray restarts it on another node. The run's secrets reach it as
    constructor arguments, never through the runtime_env that Ray's dashboard shows."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rl_cluster.trainer.actor import trainer_actor_class

    here = ray.get_runtime_context()
    return (
        trainer_actor_class(config.trainer.num_workers)
        .options(
            name=f"{config.run_name}-trainer",
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here.get_node_id(), soft=False),
            # Ray Train's placement-group cleaner (a detached actor that inherits this environment) asks Ray's
            # state API with no address: on a machine that runs two Rays it fails, and once removed a live
            # run's placement group. It asks the run's own cluster.
            runtime_env={"env_vars": {"RAY_ADDRESS": here.gcs_address}},
            # A coordinator that dies is restarted, and asked to run again (train_through_restarts): its ranks
            # resume from a checkpoint. Its other calls (report, placement) are retried by Ray.
            max_restarts=config.trainer.max_restarts,
            max_task_retries=config.trainer.max_restarts,
        )
        .remote(config, proxy, secrets.proxy_token, secrets.replica_key, secrets.environment)
    )


class LeaseNews:
    """Tells the run's trainer, the run's writer, each renewal of the lease and its loss: the trainer fences
    its own writes by them (rl_cluster.core.fence). Called on the lease's renewer thread."""

    def __init__(self):
        self.trainer = None  # the trainer actor, once made

    def renewed(self, valid_for_s: float) -> None:
        if self.trainer is not None:
            self.trainer.lease_news.remote(valid_for_s=valid_for_s)

    def lost(self, why: str) -> None:
        if self.trainer is not None:
            self.trainer.lease_news.remote(lost=why)
