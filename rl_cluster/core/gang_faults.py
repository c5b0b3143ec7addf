"""Which failures of a trainer rank are its gang's: a peer gone (killed, its node lost) ends the
surviving ranks' collectives with an error that is no fault of their training. Pure: no torch, no Ray."""

from __future__ import annotations

import re

# What a collective raises in a rank whose peer is gone (SIGKILLed, its node lost) besides torch's DistError
# family (NCCL, the rendezvous store): gloo's TCP transport raises a plain RuntimeError naming its source,
# e.g. "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.7]:44939".
PEER_GONE = re.compile(r"gloo/transport/|Connection (closed|reset) by peer")


def peer_gone(error: BaseException) -> bool:
    """Whether a rank's training failed because another rank is gone, not because of its own training.
    That is the gang's failure, which Ray Train answers with a restart (trainer.max_restarts) once it
    sees the peer dead; reported as a training error instead, it would end the run when the surviving
    rank says so first (the multi-node resume run's SIGKILLed rank 1 lost its run this way once, in a
    clean-clone `.ci/run`).

    >>> peer_gone(RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    True
    >>> peer_gone(ValueError("a reward function returned None"))
    False
    """
    torch_said_so = any(kind.__name__ == "DistError" for kind in type(error).__mro__)  # (no torch import)
    return torch_said_so or bool(PEER_GONE.search(str(error)))
