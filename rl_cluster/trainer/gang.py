"""The trainer's ranks as one gang, hosted by Ray Train: placed together on nodes with the `trainer`
resource, given a torch process group, and restarted together when one of them dies (a killed process,
a lost node), at most trainer.max_restarts times. Called by the coordinator (rl_cluster.trainer.actor) on
a thread of its own: fit() returns when every rank's function did."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rl_cluster.config import RunConfig

# Ray Train reads these where the TorchTrainer is made and hands them to its controller and workers.
TRAIN_ENVIRONMENT = {
    # The ranks keep the job's working directory (its relative .cache/ paths), not Train's trial directory.
    "RAY_CHDIR_TO_TRIAL_DIR": "0",
    # A rank's print stays a print (the progress a user reads), not a line of Train's logger; and Train
    # leaves a rank's logging alone: it would set the root logger to INFO, and TRL's, transformers' and
    # torch's INFO chatter (a line per weight sync, per stale sample) would fill the driver's console.
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING": "0",
    # A gang placed on a busy node, or restarted onto a node that is still joining, may take minutes to
    # start; Train's default of 60 s would count that as a failure and spend a restart.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600",
}


def torch_config(config: RunConfig):
    """The ranks' process group: NCCL on GPUs, gloo on CPU, each collective bounded by
    trainer.collective_timeout_s (Ray sets TORCH_NCCL_ASYNC_ERROR_HANDLING, so NCCL's bound fails too)."""
    from ray.train.torch import TorchConfig

    t = config.trainer
    return TorchConfig(backend="nccl" if t.num_gpus else "gloo", timeout_s=t.collective_timeout_s)


def fit_ranks(config: RunConfig, proxy_url: str, coordinator) -> None:
    """Run rl_cluster.trainer.rank.rank_main on each rank until every rank returned. Raises Ray Train's
    error when the gang failed more often than trainer.max_restarts allows."""
    os.environ.update(TRAIN_ENVIRONMENT)
    # Train's controller polls each rank every 2 s; a poll unanswered this long ends the attempt.
    os.environ["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] = str(config.trainer.unresponsive_timeout_s)
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from rl_cluster.trainer.rank import rank_main

    t = config.trainer
    resources = {"CPU": t.num_cpus, "trainer": 1, **({"GPU": t.num_gpus} if t.num_gpus else {})}
    trainer = TorchTrainer(
        rank_main,
        train_loop_config={"config": config, "proxy_url": proxy_url, "coordinator": coordinator},
        torch_config=torch_config(config),
        scaling_config=ray.train.ScalingConfig(
            num_workers=t.num_workers,
            use_gpu=t.num_gpus > 0,
            resources_per_worker=resources,
            placement_strategy="STRICT_PACK",
        ),
        run_config=ray.train.RunConfig(
            name=f"{config.run_name}-{time.strftime('%Y%m%d-%H%M%S')}",
            storage_path=str(Path(".cache", "ray_train").resolve()),
            failure_config=ray.train.FailureConfig(max_failures=t.max_restarts),
        ),
    )
    trainer.fit()
