"""Errors that cross process boundaries (Ray actors, the proxy's HTTP answers). Plain and picklable."""


class AdapterError(Exception):
    """An adapter version could not be loaded on a replica; the message says which file and why."""


class AdapterNotFound(AdapterError):
    """The version is not (yet) visible: no complete manifest. Retryable, since a mounted bucket can lag."""


class AdapterRejected(AdapterError):
    """The version is visible but is not what was published, or does not fit the replica. Not retryable."""


class FilesDiffer(AdapterRejected):
    """A committed directory's files are not the ones its manifest lists (missing, truncated, changed):
    what it holds is damaged, not merely unsuitable for the reader."""


class ReplicaServerError(AdapterError):
    """The replica's server answered a load with a 5xx. vLLM does so both when it is broken (a dead engine
    core) and for some adapters it refuses (a rank above its --max-lora-rank): the replica's health says
    which."""


class ReplicaDown(AdapterError):
    """The replica has no server to load into: its actor died, or Ray restarted it and it has not started
    its server again yet. A broadcast leaves it out (it catches up when it is back)."""


class ReplicaUnreachable(ReplicaDown):
    """Ray cannot reach the replica's generator actor (ActorUnavailableError): its node is cut off, or was
    and Ray has not reconnected yet, or is going away. Not dead: out of routing until a catch-up reaches it."""


class ReplicaTimeout(ReplicaDown):
    """The replica did not answer within its deadline (proxy.load_deadline_s): hung (a stopped process, a
    stalled mount, a wedged engine) or cut off. Treated as down: out of routing until it answers again."""


class ReplicaMisbehaved(ReplicaDown):
    """The replica's answer breaks the protocol: a 200 to a load it then does not serve, malformed JSON, a
    stream longer than the request allows. Its /health may still answer, so it is taken out of routing
    without asking; a catch-up that finds it sound (its /v1/models parses, every load shows) brings it back."""


class BucketUnavailable(Exception):
    """The bucket could not be reached after bounded retries."""


class RunRefused(Exception):
    """A run was refused before it started anything. The message is one line for whoever started it;
    `exit_status` is what the driver exits with (2: the run did not run)."""

    exit_status = 2


class LeaseHeld(RunRefused):
    """Another driver holds the run's lease, and it is live: one driver per run name."""


class LeaseLost(Exception):
    """This driver no longer holds its run's lease: taken over after it expired, deleted, or not renewed
    in time. The run must stop writing."""


class UsageError(RunRefused):
    """An expected failure of a command before it starts anything (a config that does not load, data not
    prepared, a run that is not there, a bucket that cannot be reached): each argument is one line saying
    what to fix. Entry points (rl_cluster.cli.guarded) print the lines, no traceback unless --debug, and
    exit with `exit_status` 2."""

    def __init__(self, *lines: str):
        super().__init__(*lines)
        self.lines = list(lines)

    def __str__(self) -> str:
        return "\n".join(self.lines)


class TrainingFailed(RuntimeError):
    """The trainer's training raised (in a rank Ray Train runs); the message is the rank's error. Not a
    reason to restart the gang: training again would raise again."""
