"""Errors that cross process boundaries (Ray actors, the proxy's HTTP answers). Plain and picklable."""


class AdapterError(Exception):
    """An adapter version could not be loaded on a replica; the message says which file and why."""


class AdapterNotFound(AdapterError):
    """The version is not (yet) visible: no complete manifest. Retryable, since a mounted bucket can lag."""


class AdapterRejected(AdapterError):
    """The version is visible but is not what was published, or does not fit the replica. Not retryable."""


class ReplicaServerError(AdapterError):
    """The replica's server answered a load with a 5xx. vLLM does so both when it is broken (a dead engine
    core) and for some adapters it refuses (a rank above its --max-lora-rank): the replica's health says
    which."""


class ReplicaDown(AdapterError):
    """The replica has no server to load into: its actor died, or Ray restarted it and it has not started
    its server again yet. A broadcast leaves it out (it catches up when it is back)."""


class BucketUnavailable(Exception):
    """The bucket could not be reached after bounded retries."""
