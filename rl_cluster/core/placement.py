"""Can the cluster ever place a run's actors, and is the driver running in a copy Ray made of its checkout?

Pure (no Ray): rl_cluster.connection reads the live nodes and the autoscaler, and asks `unplaceable`.

Ray never refuses an actor it cannot place: on a cluster started with a plain `ray start --head` (no
`trainer` or `generator` resource) the run would wait for ever, repeating `No available node types can
fulfill resource request {'generator': 1.0}`. So the driver checks first, against the totals of the live
nodes and the node types an autoscaler may add, and refuses in seconds with the line that fixes it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath

# The command that gives a single-machine cluster the run's custom resources.
FIX = """ray start --head --resources='{"trainer": 1, "generator": 2}'"""

# The read-only autoscaler that every `ray start --head` runs names each node's type `node_<node id>`.
_READONLY_TYPE = re.compile(r"node_[0-9a-f]{20,}")


@dataclass(frozen=True)
class Request:
    """One actor's resources; `node`: it is pinned to that node id (the proxy on the driver's node);
    `copies`: that many of it, on as many nodes as it takes (the trainer's ranks with trainer.span_nodes)."""

    actor: str
    resources: Mapping[str, float]
    node: str | None = field(default=None)
    copies: int = 1


def _fits(resources: Mapping[str, float], totals: Mapping[str, float]) -> bool:
    return all(totals.get(name, 0.0) >= amount for name, amount in resources.items() if amount > 0)


def _how_many(resources: Mapping[str, float], totals: Mapping[str, float]) -> int:
    """Copies of `resources` one node of these totals holds."""
    return int(
        min((totals.get(name, 0.0) // amount for name, amount in resources.items() if amount > 0), default=0)
    )


def unplaceable(
    requests: Sequence[Request],
    nodes: Mapping[str, Mapping[str, float]],
    node_types: Sequence[Mapping[str, float]] = (),
) -> dict[str, list[str]]:
    """{actor: the resources no node can hold enough of} for each request that fits on no live node
    (`nodes`: node id -> total resources) and on no node type an autoscaler may add. Each request is
    checked alone: a cluster that can hold every actor, just not all at once, queues rather than hangs.

    >>> unplaceable([Request("trainer", {"trainer": 1, "CPU": 1})], {"n1": {"CPU": 2}})
    {'trainer': ['trainer']}
    """
    missing = {}
    for request in requests:
        candidates = [nodes[request.node]] if request.node in nodes else []
        if request.node is None:
            candidates = [*nodes.values(), *node_types]
        if request.copies > 1 and request.node is None:
            # Spread over nodes: the live ones together, or a node type the autoscaler adds as often as needed.
            if sum(
                _how_many(request.resources, totals) for totals in nodes.values()
            ) >= request.copies or any(_fits(request.resources, totals) for totals in node_types):
                continue
            together = " + ".join(name for name, amount in request.resources.items() if amount > 0)
            missing[request.actor] = [f"{request.copies} x ({together}) across the nodes"]
            continue
        if any(_fits(request.resources, totals) for totals in candidates):
            continue
        short = [
            name
            for name, amount in request.resources.items()
            if amount > 0 and not any(totals.get(name, 0.0) >= amount for totals in candidates)
        ]
        # Each resource is on some node, just not all of them on one.
        together = " + ".join(name for name, amount in request.resources.items() if amount > 0)
        missing[request.actor] = short or [f"{together} on one node"]
    return missing


def adds_nodes(autoscaler_report: Mapping | None) -> bool | None:
    """Whether the autoscaler of this report (the `autoscaler_report` of Ray's autoscaling status) can add
    nodes: False for the read-only one of a plain `ray start --head` (it knows only the live nodes, each
    its own made-up `node_<id>` type), True for one with node types of a cluster config (`ray up`, the
    fake multi-node one), None when there is no report (yet)."""
    if not autoscaler_report:
        return None
    types = {
        *(autoscaler_report.get("active_nodes") or {}),
        *(autoscaler_report.get("idle_nodes") or {}),
        *(autoscaler_report.get("pending_launches") or {}),
        *(autoscaler_report.get("node_type_mapping") or {}).values(),
        *(pending[1] for pending in autoscaler_report.get("pending_nodes") or ()),
    }
    return any(not _READONLY_TYPE.fullmatch(str(name)) for name in types)


def refusal(missing: Mapping[str, Sequence[str]]) -> str:
    """The one line for `unplaceable`'s answer."""
    what = "; ".join(f"{actor} needs {', '.join(resources)}" for actor, resources in missing.items())
    return (
        f"no node of this Ray cluster can ever hold the run's actors ({what}) and no autoscaler node type "
        f"adds one: start the cluster with the custom resources, e.g. `{FIX}` (one generator per "
        "`generator`), or give its node types `trainer` / `generator` resources"
    )


def ray_package_dir(path: str) -> str | None:
    """The directory Ray unpacked a job's `--working-dir` into (`<ray temp>/session_*/runtime_resources/
    working_dir_files/_ray_pkg_<hash>`) that `path` lies in, else None. Whatever a job writes there stays
    on that node, in a copy deleted with the session: never the user's checkout."""
    parts = PurePath(path).parts
    for i in range(len(parts) - 2):
        if parts[i : i + 2] == ("runtime_resources", "working_dir_files") and parts[i + 2].startswith(
            "_ray_pkg_"
        ):
            return str(PurePath(*parts[: i + 3]))
    return None


def is_relative_directory(uri: str) -> bool:
    """A bucket.uri that is a directory relative to the driver's working directory: not s3:// and not
    absolute (the bucket expands no `~`: `~/b` is a directory named `~` there)."""
    return not uri.startswith("s3://") and not PurePath(uri).is_absolute()
