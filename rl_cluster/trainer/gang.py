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


def gloo_interface(address: str, interfaces: dict[str, list[str]]) -> str | None:
    """The network interface that holds `address` (`interfaces`: name -> its addresses), or None.

    >>> gloo_interface("10.0.0.7", {"lo": ["127.0.0.1"], "eth0": ["10.0.0.7", "fe80::1"]})
    'eth0'
    """
    return next((name for name, addresses in interfaces.items() if address in addresses), None)


def bind_gloo_to_node_address() -> None:
    """Run on each rank before its process group forms: gloo binds to the interface of the address Ray
    knows this node by, unless GLOO_SOCKET_IFNAME is set already.

    Without it torch's gloo binds to whatever the machine's hostname resolves to and falls back to
    loopback: where the hostname is 127.0.0.1 (host-networked pods, network namespaces, many /etc/hosts)
    every rank then advertises 127.0.0.1 to the others, and a gang across nodes fails in
    connectFullMesh ("Connection refused, remote=[127.0.0.1]") after the collective timeout. Ray's own
    rendezvous (MASTER_ADDR) already uses the node address; this makes gloo's pairs use it too."""
    import psutil
    import ray

    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    interfaces = {name: [a.address for a in addrs] for name, addrs in psutil.net_if_addrs().items()}
    if name := gloo_interface(ray.util.get_node_ip_address(), interfaces):
        os.environ["GLOO_SOCKET_IFNAME"] = name


def torch_config(config: RunConfig):
    """The ranks' process group: NCCL on GPUs, gloo on CPU (and for CPU tensors beside NCCL), gloo bound to
    each node's Ray address, each collective bounded by trainer.collective_timeout_s (Ray sets
    TORCH_NCCL_ASYNC_ERROR_HANDLING, so NCCL's bound fails too)."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend  # no public hook runs before the group forms

    class NodeAddressBackend(_TorchBackend):
        def on_start(self, worker_group, backend_config):
            worker_group.execute(bind_gloo_to_node_address)
            super().on_start(worker_group, backend_config)

    class NodeAddressTorchConfig(TorchConfig):
        @property
        def backend_cls(self):
            return NodeAddressBackend

    t = config.trainer
    return NodeAddressTorchConfig(backend="nccl" if t.num_gpus else "gloo", timeout_s=t.collective_timeout_s)


def fit_ranks(config: RunConfig, proxy, coordinator) -> None:
    """Run rl_cluster.trainer.rank.rank_main on each rank until every rank returned. Raises Ray Train's
    error when the gang failed more often than trainer.max_restarts allows. `proxy`: the run's proxy
    actor, which each rank asks where it serves."""
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
        train_loop_config={"config": config, "proxy": proxy, "coordinator": coordinator},
        torch_config=torch_config(config),
        scaling_config=ray.train.ScalingConfig(
            num_workers=t.num_workers,
            use_gpu=t.num_gpus > 0,
            resources_per_worker=resources,
            # As few nodes as hold them all (PACK), or one node whatever it takes (STRICT_PACK).
            placement_strategy="PACK" if t.span_nodes else "STRICT_PACK",
        ),
        run_config=ray.train.RunConfig(
            name=f"{config.run_name}-{time.strftime('%Y%m%d-%H%M%S')}",
            storage_path=str(Path(".cache", "ray_train").resolve()),
            failure_config=ray.train.FailureConfig(max_failures=t.max_restarts),
        ),
    )
    trainer.fit()
