"""A rank whose peer is gone fails the gang, not the run: what the surviving rank's collective raises is
told apart from an error of its own training (rl_cluster.core.gang_faults.peer_gone), on a real gloo pair."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import signal

import pytest
import spawn_targets
from conftest import free_port

from rl_cluster.core.gang_faults import peer_gone


def test_the_collective_of_a_rank_whose_peer_was_killed_says_the_peer_is_gone(monkeypatch):
    import torch
    import torch.distributed as dist

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the pair on loopback (the child inherits it)
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    peer = mp.get_context("spawn").Process(target=spawn_targets.gloo_rank_that_dies, args=(port,))
    peer.start()
    try:
        group = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=60))
        both = torch.ones(1)
        group.allreduce([both]).wait()
        assert both.item() == 2.0  # the pair works
        peer.join(60)
        assert peer.exitcode == -signal.SIGKILL
        with pytest.raises(RuntimeError) as raised:
            group.allreduce([torch.ones(1)]).wait()
    finally:
        if peer.is_alive():
            peer.kill()
    # Not one of torch's DistErrors: gloo's transport raises a plain RuntimeError, told by its message.
    assert not isinstance(raised.value, dist.DistError) and "Connection closed by peer" in str(raised.value)
    assert peer_gone(raised.value), repr(raised.value)
    assert peer_gone(dist.DistBackendError("NCCL communicator was aborted on rank 0"))  # torch's own kind
    # An error of the rank's own training is no peer's.
    assert not peer_gone(ValueError("a reward function returned None"))
    assert not peer_gone(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"))
