"""Which of a run's actors no node, live or to come, can ever hold (rl_cluster.core.placement)."""

from __future__ import annotations

from rl_cluster.core.placement import (
    Request,
    adds_nodes,
    is_relative_directory,
    ray_package_dir,
    refusal,
    unplaceable,
)

RUN = [
    Request("proxy", {"CPU": 0.0}, "head"),
    Request("generator", {"generator": 1, "GPU": 0.0}),
    Request("trainer", {"trainer": 1, "CPU": 1.0, "GPU": 0.0}),
]
PLAIN_HEAD = {"head": {"CPU": 2.0, "memory": 1e9}}


def test_a_plain_head_holds_neither_the_generator_nor_the_trainer():
    assert unplaceable(RUN, PLAIN_HEAD) == {"generator": ["generator"], "trainer": ["trainer"]}


def test_a_head_with_the_custom_resources_holds_every_actor():
    assert unplaceable(RUN, {"head": {"CPU": 2.0, "trainer": 1.0, "generator": 2.0}}) == {}


def test_each_actor_may_sit_on_its_own_node():
    nodes = {"head": {"CPU": 2.0}, "t": {"CPU": 4.0, "trainer": 1.0}, "g": {"CPU": 1.0, "generator": 1.0}}
    assert unplaceable(RUN, nodes) == {}


def test_every_resource_of_a_request_must_be_on_one_node():
    # A trainer wanting a GPU: the node with `trainer` has none, the one with a GPU has no `trainer`.
    gpu_trainer = [Request("trainer", {"trainer": 1, "CPU": 1.0, "GPU": 1.0})]
    nodes = {"a": {"CPU": 4.0, "trainer": 1.0}, "b": {"CPU": 4.0, "GPU": 8.0}}
    assert unplaceable(gpu_trainer, nodes) == {"trainer": ["trainer + CPU + GPU on one node"]}
    assert unplaceable(gpu_trainer, {"a": {"CPU": 4.0, "trainer": 1.0, "GPU": 1.0}}) == {}


def test_too_few_cpus_on_every_node_is_named():
    assert unplaceable(
        [Request("trainer", {"trainer": 1, "CPU": 8.0})], {"h": {"CPU": 2.0, "trainer": 1.0}}
    ) == {"trainer": ["CPU"]}


def test_ranks_that_span_nodes_count_every_node_together():
    # Two GPU ranks (trainer.span_nodes): two one-GPU trainer nodes hold them, one does not.
    ranks = [Request("trainer", {"trainer": 1, "CPU": 1.0, "GPU": 1.0}, copies=2)]
    one_gpu = {"CPU": 4.0, "trainer": 4.0, "GPU": 1.0}
    assert unplaceable(ranks, {"a": one_gpu, "b": one_gpu}) == {}
    assert unplaceable(ranks, {"a": one_gpu, "b": {"CPU": 4.0, "GPU": 8.0}}) == {
        "trainer": ["2 x (trainer + CPU + GPU) across the nodes"]
    }
    assert unplaceable(ranks, {"a": {"CPU": 4.0, "trainer": 2.0, "GPU": 2.0}}) == {}
    # The autoscaler adds a node type that holds one rank as often as it takes.
    assert unplaceable(ranks, {}, [one_gpu]) == {}


def test_a_node_type_the_autoscaler_may_add_counts():
    types = [{"CPU": 1.0, "generator": 1.0}, {"CPU": 8.0, "GPU": 1.0, "trainer": 1.0}]
    assert unplaceable(RUN, PLAIN_HEAD, types) == {}
    assert unplaceable(RUN, PLAIN_HEAD, types[:1]) == {"trainer": ["trainer"]}


def test_a_pinned_request_counts_only_its_own_node():
    pinned = [Request("proxy", {"CPU": 4.0}, "head")]
    assert unplaceable(pinned, {"head": {"CPU": 2.0}, "big": {"CPU": 64.0}}, [{"CPU": 64.0}]) == {
        "proxy": ["CPU"]
    }
    assert unplaceable(pinned, {"head": {"CPU": 4.0}}) == {}


def test_the_refusal_is_one_line_naming_what_is_missing_and_the_fix():
    line = refusal(unplaceable(RUN, PLAIN_HEAD))
    assert "\n" not in line
    assert "generator needs generator" in line and "trainer needs trainer" in line
    assert """ray start --head --resources='{"trainer": 1, "generator": 2}'""" in line


NODE = "0fc62bf023b5a240ef6988c0b92a86de65e145d2a62e03525dfa2b60"


def test_the_read_only_autoscaler_of_a_plain_head_adds_no_node():
    report = {"active_nodes": {f"node_{NODE}": 1}, "pending_launches": {}, "pending_nodes": [],
              "node_type_mapping": {NODE: f"node_{NODE}"}}  # fmt: skip
    assert adds_nodes(report) is False


def test_an_autoscaler_with_node_types_may_add_nodes():
    report = {"active_nodes": {"ray.head.default": 1}, "pending_launches": {"generator": 1},
              "node_type_mapping": {NODE: "ray.head.default"}}  # fmt: skip
    assert adds_nodes(report) is True


def test_no_autoscaler_report_tells_nothing():
    assert adds_nodes(None) is None and adds_nodes({}) is None


def test_a_job_package_directory_is_recognised():
    pkg = "/tmp/ray/session_2026-12-02_09-21-11_923385_31725/runtime_resources/working_dir_files/_ray_pkg_dbbd5c"
    assert ray_package_dir(pkg) == pkg
    assert ray_package_dir(f"{pkg}/rl_cluster/core") == pkg
    assert ray_package_dir("/home/me/rl_cluster") is None
    assert ray_package_dir("/x/runtime_resources/working_dir_files") is None


def test_relative_bucket_uris():
    assert is_relative_directory("bucket") and is_relative_directory("./b") and is_relative_directory("~/b")
    assert not is_relative_directory("/mnt/rl-bucket") and not is_relative_directory("s3://b/runs")


def test_a_tensor_parallel_replica_needs_a_node_with_as_many_generator_devices():
    tp2 = [Request("generator", {"generator": 2, "GPU": 2.0})]
    assert unplaceable(tp2, {"g": {"CPU": 8.0, "GPU": 1.0, "generator": 1.0}}) == {
        "generator": ["generator", "GPU"]
    }
    assert unplaceable(tp2, {"g": {"CPU": 8.0, "GPU": 8.0, "generator": 8.0}}) == {}
