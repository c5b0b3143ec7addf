"""The cluster configs in ray_configs/ and the Dockerfile, checked with Ray's own code (no cluster started).

- `ray_configs/cluster.yaml` goes through what `ray up` does before it talks to the cloud:
  `prepare_config` (defaults of the provider) then `validate_config` (Ray's ray-schema.json plus its
  cross-field checks), then through our checks of the node types rl_cluster places actors on.
- The KubeRay manifests' RayCluster spec goes through `_derive_autoscaling_config_from_ray_cr`, the
  translation Ray's KubeRay autoscaler applies to the RayCluster custom resource, and the derived config
  is validated by `validate_config` again.
Each validator is also shown a broken copy, to prove it rejects one.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "ray_configs" / "cluster.yaml"
KUBERAY = REPO / "ray_configs" / "kuberay"
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

BUCKET_PATH = "/mnt/rl-bucket"
IMAGE = "ghcr.io/rl-cluster/rl-cluster:0.1.0"
# The worker groups rl_cluster needs: (custom resource, min workers, max workers). The numbers are the
# ones written in the configs; the tests also read them back from the YAML and compare.
GROUPS = {"trainer": ("trainer", 1, 1), "generator": ("generator", 1, 8)}


def _one_per_gpu(resources: dict, resource: str) -> bool:
    """A node carries 1 to (its GPUs) of the group's resource: each unit is a rank or a replica of one GPU."""
    return 1 <= resources.get(resource, 0) <= max(1, resources.get("GPU", 0))


def load(path: Path):
    return yaml.safe_load(path.read_text())


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# ---------------------------------------------------------------------------------------------------
# cluster.yaml: Ray's launcher validation, then our node types


def check_launcher_config(config: dict) -> dict:
    """What `ray up` does to a cluster YAML before any cloud call (fill the provider's defaults, validate
    against Ray's schema and cross-field rules), then rl_cluster's own requirements. Returns the prepared
    config; raises jsonschema.ValidationError or ValueError on a bad one."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    if head["max_workers"] != 0 or set(head["resources"]) & set(GROUPS):
        raise ValueError("the head must not carry the trainer or generator resource")
    for name, (resource, lo, hi) in GROUPS.items():
        if name not in types:
            raise ValueError(f"no node type {name!r}")
        node = types[name]
        if not _one_per_gpu(node["resources"], resource):
            raise ValueError(f"node type {name!r} lacks the custom resource {resource} (1 up to its GPUs)")
        if node["resources"].get("GPU", 0) < 1:
            raise ValueError(f"node type {name!r} has no GPU")
        if (node["min_workers"], node["max_workers"]) != (lo, hi):
            raise ValueError(
                f"node type {name!r}: min/max workers {node['min_workers']}/{node['max_workers']}"
            )
    others = [t for n, t in types.items() if n not in GROUPS and set(t["resources"]) & set(GROUPS)]
    if others:
        raise ValueError("only the trainer and generator node types may carry those resources")
    worker_max = sum(t["max_workers"] for n, t in types.items() if n != prepared["head_node_type"])
    if worker_max > prepared["max_workers"]:
        raise ValueError(f"global max_workers {prepared['max_workers']} caps the node types' {worker_max}")
    return prepared


def test_cluster_yaml_passes_rays_launcher_validation():
    raw = load(CLUSTER_YAML)
    prepared = check_launcher_config(raw)
    types = prepared["available_node_types"]
    assert set(types) == {"head", "trainer", "generator"}
    # The numbers as written in the YAML survive Ray's preparation unchanged.
    for name in GROUPS:
        written = raw["available_node_types"][name]
        assert (types[name]["min_workers"], types[name]["max_workers"]) == (
            written["min_workers"],
            written["max_workers"],
        )
        assert types[name]["resources"] == written["resources"]
    assert (types["trainer"]["min_workers"], types["trainer"]["max_workers"]) == (1, 1)
    assert (types["generator"]["min_workers"], types["generator"]["max_workers"]) == (1, 8)
    assert prepared["max_workers"] == 9


def _misspelled_node_key(c):
    c["available_node_types"]["generator"]["min_worker"] = c["available_node_types"]["generator"].pop(
        "min_workers"
    )


def _misspelled_top_key(c):
    c["idle_timeout_minute"] = c.pop("idle_timeout_minutes")


def _string_resource(c):
    c["available_node_types"]["generator"]["resources"]["generator"] = "1"


def _unknown_head_type(c):
    c["head_node_type"] = "headnode"


def _global_max_below_min(c):
    c["max_workers"] = 1  # trainer 1 + generator 1 at least


def _misspelled_docker_key(c):
    c["docker"]["run_option"] = c["docker"].pop("run_options")


def _generator_without_resource(c):
    del c["available_node_types"]["generator"]["resources"]["generator"]


def _trainer_without_gpu(c):
    del c["available_node_types"]["trainer"]["resources"]["GPU"]


def _generators_capped(c):
    c["max_workers"] = 4


@pytest.mark.parametrize(
    "mistake,error",
    [
        (_misspelled_node_key, jsonschema.ValidationError),
        (_misspelled_top_key, jsonschema.ValidationError),
        (_string_resource, jsonschema.ValidationError),
        (_misspelled_docker_key, jsonschema.ValidationError),
        (_unknown_head_type, ValueError),
        (_global_max_below_min, ValueError),
        (_generator_without_resource, ValueError),
        (_trainer_without_gpu, ValueError),
        (_generators_capped, ValueError),
    ],
    ids=lambda v: getattr(v, "__name__", "").lstrip("_"),
)
def test_launcher_validation_rejects_a_broken_copy(mistake, error):
    config = load(CLUSTER_YAML)
    check_launcher_config(config)  # the shipped one passes ...
    mistake(config)
    with pytest.raises(error):  # ... the broken copy does not
        check_launcher_config(config)


# ---------------------------------------------------------------------------------------------------
# cluster.yaml: the bucket mount fails the node's setup when it fails


STUBS = {
    "sudo": 'exec "$@"',
    "mount": 'echo "$@" >> "$STATE/mount.log"; [ -n "$MOUNT_OK" ] && touch "$STATE/mounted"; [ -n "$MOUNT_OK" ]',
    "mountpoint": '[ -e "$STATE/mounted" ]',
    "mount.nfs4": "exit 0",
    "chown": "exit 0",
    "apt-get": "exit 0",
}


def run_node_setup(commands: list[str], tmp_path: Path, *, mount_ok: bool) -> int | None:
    """Run a node's commands the way Ray's NodeUpdater does (one after another, stop at the first that
    exits non-zero), with the bucket path moved under tmp_path and mount/sudo/mountpoint stubbed. Returns
    the index of the command that failed the setup, or None when the setup succeeded."""
    bin_dir, state, bucket = tmp_path / "bin", tmp_path / "state", tmp_path / "mnt" / "rl-bucket"
    bin_dir.mkdir()
    state.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STATE": str(state)}
    if mount_ok:
        env["MOUNT_OK"] = "1"
    for i, command in enumerate(commands):
        result = subprocess.run(["bash", "-c", command.replace(BUCKET_PATH, str(bucket))], env=env)
        if result.returncode != 0:
            return i
    return None


def node_commands(config: dict) -> list[str]:
    return [*config.get("initialization_commands", []), *config.get("setup_commands", [])]


def mount_command_index(commands: list[str]) -> int:
    (index,) = [i for i, c in enumerate(commands) if "sudo mount " in c]
    return index


def test_a_failed_bucket_mount_fails_the_node_setup(tmp_path):
    config = load(CLUSTER_YAML)
    commands = node_commands(config)
    failed = run_node_setup(commands, tmp_path, mount_ok=False)
    assert failed is not None, "a node whose bucket mount failed finished its setup"
    assert failed == mount_command_index(commands)
    assert failed < len(config["initialization_commands"]), "the failure must stop setup before the container"
    assert (tmp_path / "state" / "mount.log").exists(), "the mount was never attempted"


def test_a_masked_mount_failure_is_still_caught_by_the_mountpoint_check(tmp_path):
    """Even if the mount's exit status were swallowed, the next check finds no mount and stops the node."""
    commands = node_commands(load(CLUSTER_YAML))
    mount = mount_command_index(commands)
    commands[mount] += " || true"
    failed = run_node_setup(commands, tmp_path, mount_ok=False)
    assert failed == mount + 1
    assert commands[failed].startswith("mountpoint -q ")


def test_a_working_bucket_mount_lets_the_node_setup_finish(tmp_path):
    assert run_node_setup(node_commands(load(CLUSTER_YAML)), tmp_path, mount_ok=True) is None
    assert "nfs4" in (tmp_path / "state" / "mount.log").read_text()


def test_the_old_or_true_mount_would_have_passed_a_failed_mount(tmp_path):
    """The harness above catches what the old config did: `mount ... || true` left an empty directory."""
    old = [
        f"sudo mkdir -p {BUCKET_PATH} && sudo chown ubuntu {BUCKET_PATH}",
        f"sudo mount -t nfs4 server:/ {BUCKET_PATH} || true",
    ]
    assert run_node_setup(old, tmp_path, mount_ok=False) is None


def test_the_container_sees_the_hosts_bucket_mount():
    config = load(CLUSTER_YAML)
    options = [shlex.split(o) for o in config["docker"]["run_options"]]
    volumes = [o[1] for o in options if o[0] in ("--volume", "-v")]
    assert f"{BUCKET_PATH}:{BUCKET_PATH}" in volumes
    assert not any("|| true" in c for c in node_commands(config))


# ---------------------------------------------------------------------------------------------------
# KubeRay: Ray's translation of the RayCluster CR into an autoscaling config


def as_ray_cluster(spec: dict, name: str = "rl-cluster") -> dict:
    """A RayCluster custom resource as the KubeRay autoscaler reads it from the API server (which always
    has a namespace)."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "namespace": "default"},
        "spec": copy.deepcopy(spec),
    }


def check_kuberay_spec(spec: dict) -> dict:
    """Ray's KubeRay translation of the spec (it raises on what it cannot read), validated again with the
    launcher validation, then checked against the spec's own numbers and rl_cluster's groups. Returns the
    derived autoscaling config; raises on a mismatch."""
    derived = _derive_autoscaling_config_from_ray_cr(as_ray_cluster(spec))
    validate_config(derived)
    if spec.get("enableInTreeAutoscaling") is not True:
        raise ValueError("enableInTreeAutoscaling is off: nothing would add generator pods")
    types = derived["available_node_types"]
    head = types[derived["head_node_type"]]
    if set(head["resources"]) & set(GROUPS):
        raise ValueError("the head must not carry the trainer or generator resource")
    written = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    for name, (resource, lo, hi) in GROUPS.items():
        if name not in types:
            raise ValueError(f"no worker group {name!r}")
        node, group = types[name], written[name]
        hosts = group.get("numOfHosts", 1)
        as_written = (group["minReplicas"] * hosts, group["maxReplicas"] * hosts)
        if (node["min_workers"], node["max_workers"]) != as_written:
            raise ValueError(f"group {name!r}: derived min/max differ from the YAML's {as_written}")
        if as_written != (lo, hi):
            raise ValueError(f"group {name!r}: min/max {as_written}, expected {(lo, hi)}")
        if not lo <= group.get("replicas", lo) <= hi:
            raise ValueError(f"group {name!r}: replicas outside min/max")
        if not _one_per_gpu(node["resources"], resource):
            raise ValueError(f"group {name!r} lacks the custom resource {resource} (1 up to its GPUs)")
        if node["resources"].get("GPU", 0) < 1:
            raise ValueError(f"group {name!r} has no GPU")
        for other in GROUPS.values():
            if other[0] != resource and other[0] in node["resources"]:
                raise ValueError(f"group {name!r} also carries {other[0]}")
    return derived


def kuberay_specs() -> dict[str, dict]:
    raycluster = load(KUBERAY / "raycluster.yaml")
    rayjob = load(KUBERAY / "rayjob.yaml")
    assert (raycluster["kind"], rayjob["kind"]) == ("RayCluster", "RayJob")
    return {"raycluster.yaml": raycluster["spec"], "rayjob.yaml": rayjob["spec"]["rayClusterSpec"]}


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayjob.yaml"])
def test_kuberay_spec_translates_to_our_groups(manifest):
    derived = check_kuberay_spec(kuberay_specs()[manifest])
    types = derived["available_node_types"]
    assert set(types) == {"headgroup", "trainer", "generator"}
    assert (types["trainer"]["min_workers"], types["trainer"]["max_workers"]) == (1, 1)
    assert (types["generator"]["min_workers"], types["generator"]["max_workers"]) == (1, 8)
    assert types["trainer"]["resources"]["trainer"] == types["trainer"]["resources"]["GPU"] == 8  # 8 ranks
    assert types["generator"]["resources"]["generator"] == 1
    assert derived["max_workers"] == 9


def test_rayjob_creates_the_same_cluster_as_the_raycluster():
    specs = kuberay_specs()
    assert specs["rayjob.yaml"] == specs["raycluster.yaml"]


def test_kuberay_and_launcher_agree_on_the_groups():
    launcher = check_launcher_config(load(CLUSTER_YAML))["available_node_types"]
    derived = check_kuberay_spec(kuberay_specs()["raycluster.yaml"])["available_node_types"]
    for name, (resource, _, _) in GROUPS.items():
        assert (launcher[name]["min_workers"], launcher[name]["max_workers"]) == (
            derived[name]["min_workers"],
            derived[name]["max_workers"],
        )
        assert launcher[name]["resources"][resource] == derived[name]["resources"][resource]
        assert launcher[name]["resources"]["GPU"] == derived[name]["resources"]["GPU"]


def _group(spec, name):
    return next(g for g in spec["workerGroupSpecs"] if g["groupName"] == name)


def _k8s_generator_without_resource(spec):
    del _group(spec, "generator")["rayStartParams"]["resources"]


def _k8s_trainer_with_generator_resource(spec):
    _group(spec, "trainer")["rayStartParams"]["resources"] = '"{\\"generator\\": 1}"'


def _k8s_unquoted_resources(spec):
    _group(spec, "generator")["rayStartParams"]["resources"] = '{"generator": 1}'


def _k8s_misspelled_max_replicas(spec):
    _group(spec, "generator")["maxReplica"] = _group(spec, "generator").pop("maxReplicas")


def _k8s_no_autoscaling(spec):
    spec["enableInTreeAutoscaling"] = False


def _k8s_generator_without_gpu(spec):
    del _group(spec, "generator")["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"
    ]


def _k8s_replicas_out_of_range(spec):
    _group(spec, "generator")["replicas"] = 9


@pytest.mark.parametrize(
    "mistake,error",
    [
        (_k8s_generator_without_resource, ValueError),
        (_k8s_trainer_with_generator_resource, ValueError),
        (_k8s_unquoted_resources, ValueError),  # json.JSONDecodeError, from Ray's parser
        (_k8s_misspelled_max_replicas, KeyError),  # from Ray's translation
        (_k8s_no_autoscaling, ValueError),
        (_k8s_generator_without_gpu, ValueError),
        (_k8s_replicas_out_of_range, ValueError),
    ],
    ids=lambda v: getattr(v, "__name__", "").lstrip("_"),
)
def test_kuberay_check_rejects_a_broken_copy(mistake, error):
    spec = kuberay_specs()["raycluster.yaml"]
    check_kuberay_spec(spec)
    mistake(spec)
    with pytest.raises(error):
        check_kuberay_spec(spec)


# ---------------------------------------------------------------------------------------------------
# KubeRay: the bucket volume


def pod_specs(spec: dict) -> list[dict]:
    return [
        spec["headGroupSpec"]["template"]["spec"],
        *(g["template"]["spec"] for g in spec["workerGroupSpecs"]),
    ]


def test_bucket_pvc_is_defined_and_read_write_many():
    docs = {doc["kind"]: doc for doc in load_all(KUBERAY / "bucket-pvc.yaml")}
    pvc = docs["PersistentVolumeClaim"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert pvc["spec"]["storageClassName"] == docs["StorageClass"]["metadata"]["name"]
    assert docs["StorageClass"]["provisioner"] == "efs.csi.aws.com"


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayjob.yaml"])
def test_every_pod_mounts_the_bucket_claim_at_the_same_path(manifest):
    claim = next(d for d in load_all(KUBERAY / "bucket-pvc.yaml") if d["kind"] == "PersistentVolumeClaim")
    pods = pod_specs(kuberay_specs()[manifest])
    assert len(pods) == 3
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        ray_container = pod["containers"][0]  # KubeRay: the Ray container is the first one
        mounts = [m for m in ray_container["volumeMounts"] if m["mountPath"] == BUCKET_PATH]
        assert len(mounts) == 1, f"{ray_container['name']} does not mount {BUCKET_PATH}"
        volume = volumes[mounts[0]["name"]]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_rayjob_entrypoint_uses_the_mounted_bucket_and_the_image_repo():
    entrypoint = shlex.split(load(KUBERAY / "rayjob.yaml")["spec"]["entrypoint"])
    assert [a.split("=", 1)[1] for a in entrypoint if a.startswith("bucket.uri=")] == [BUCKET_PATH]
    workdir = dockerfile_args("WORKDIR")[-1]
    paths = [a for a in entrypoint if a.startswith("/home/")]
    assert len(paths) == 2  # the script and its --config
    for path in paths:
        assert path.startswith(workdir + "/")
        assert (REPO / path.removeprefix(workdir + "/")).is_file(), path


# ---------------------------------------------------------------------------------------------------
# The image: one tag everywhere, built from the Ray this repo pins


def dockerfile_steps() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each Dockerfile step, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(op.upper(), args.strip()) for op, _, args in (ln.partition(" ") for ln in lines)]


def dockerfile_args(instruction: str) -> list[str]:
    return [args for op, args in dockerfile_steps() if op == instruction]


def images_named() -> list[str]:
    cluster = load(CLUSTER_YAML)
    docker = cluster["docker"]
    images = [docker[k] for k in ("image", "head_image", "worker_image") if k in docker]
    for node_type in cluster["available_node_types"].values():
        images += [v for k, v in node_type.get("docker", {}).items() if k.endswith("image")]
    for spec in kuberay_specs().values():
        for pod in pod_specs(spec):
            images += [c["image"] for c in pod["containers"]]
    return images


def test_every_config_names_the_same_image_tagged_with_the_project_version():
    images = images_named()
    assert len(images) == 1 + 2 * 3  # cluster.yaml, and head + 2 groups in each KubeRay manifest
    assert set(images) == {IMAGE}
    assert IMAGE.rsplit(":", 1)[1] == PYPROJECT["project"]["version"]
    assert IMAGE in DOCKERFILE.read_text()  # the build command in its header


def test_dockerfile_builds_on_the_pinned_ray():
    (base,) = dockerfile_args("FROM")
    match = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-(gpu|cu\d+)", base)
    assert match, f"FROM {base} is not a rayproject/ray GPU image"
    ray_version, python = Version(match[1]), f"{match[2]}.{match[3]}"
    ray_pin = next(
        Requirement(r) for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == "ray"
    )
    assert "default" in ray_pin.extras
    assert ray_version in ray_pin.specifier, f"image Ray {ray_version} outside the pin {ray_pin.specifier}"
    assert Version(python) in SpecifierSet(PYPROJECT["project"]["requires-python"])
    # The KubeRay manifests declare the same Ray, and the validators used here are that release's.
    assert {spec["rayVersion"] for spec in kuberay_specs().values()} == {str(ray_version)}
    assert Version(ray.__version__).release[:2] == ray_version.release[:2]


def test_dockerfile_installs_the_gpu_extra_from_copied_sources():
    steps = dockerfile_steps()
    workdir = dockerfile_args("WORKDIR")[-1]
    copied: list[str] = []
    installed_at = None
    for i, (op, args) in enumerate(steps):
        if op == "COPY":
            *sources, _dest = [a for a in shlex.split(args) if not a.startswith("--")]
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repo"
            copied += sources
        if op == "RUN":
            words = shlex.split(args)
            if "pip" in words and "install" in words:
                targets = [w for w in words if w.startswith(".[")]
                assert targets == [".[gpu]"]
                assert "gpu" in PYPROJECT["project"]["optional-dependencies"]
                installed_at = i
                # What setuptools needs to build the package is copied before the install.
                needed = {"pyproject.toml", PYPROJECT["project"]["readme"], "rl_cluster"}
                assert needed <= set(copied), needed - set(copied)
    assert installed_at is not None, 'no RUN pip install ".[gpu]"'
    assert {"jobs", "rl_cluster"} <= set(copied)
    assert workdir == "/home/ray/rl_cluster"


# ---------------------------------------------------------------------------------------------------
# The GPU recipes on these clusters: the shape each states, and the commands that start them

RECIPES = sorted(p for p in (REPO / "jobs" / "configs").glob("*.toml") if not p.name.startswith("cpu_"))
# The recipe header's statement of its cluster, e.g. "1 trainer node with 1 GPU, 4 generator nodes with 1
# GPU each" (comment lines joined: it may wrap).
SHAPE = re.compile(
    r"(?P<trainers>\d+) trainer nodes? with (?P<trainer_gpus>\d+) GPUs?, "
    r"(?P<generators>\d+) generator nodes? with (?P<generator_gpus>\d+) GPUs? each"
)
# A command that starts a run: the script (or the image's copy of it), its --config, its arguments.
TRAIN = re.compile(r"python (?P<script>\S*jobs/train_grpo\.py) (?P<args>[^\n`\\]*)")


def stated_shape(recipe: Path) -> dict[str, int]:
    header = " ".join(ln.lstrip("#").strip() for ln in recipe.read_text().splitlines() if ln.startswith("#"))
    match = SHAPE.search(header)
    assert match, (
        f"{recipe.name} states no cluster shape ('N trainer node with G GPU, M generator nodes ...')"
    )
    return {k: int(v) for k, v in match.groupdict().items()}


def cluster_node_types() -> dict[str, tuple[dict, dict]]:
    """{file: (node types as Ray reads them, the group sizes a first start brings up)}: cluster.yaml after
    `ray up`'s preparation (its min_workers), each KubeRay spec after the autoscaler's translation (the
    groups' replicas)."""
    launcher = check_launcher_config(load(CLUSTER_YAML))["available_node_types"]
    found = {"cluster.yaml": (launcher, {n: launcher[n]["min_workers"] for n in GROUPS})}
    for manifest, spec in kuberay_specs().items():
        derived = check_kuberay_spec(spec)["available_node_types"]
        found[manifest] = (derived, {n: _group(spec, n).get("replicas", 0) for n in GROUPS})
    return found


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_each_gpu_recipe_fits_the_shape_it_states_on_every_cluster_file(recipe):
    """The recipe's trainer and generators fit the node types, the shape it states is what they need (one
    replica per `generator.tensor_parallel_size` of a node's `generator` resources), and the autoscaler may
    grow each group to it."""
    from rl_cluster.config import load_config
    from rl_cluster.core.placement import Request, unplaceable

    config, shape = load_config(recipe), stated_shape(recipe)
    t, g = config.trainer, config.generator
    assert g.num_gpus == shape["generator_gpus"], "GPUs as stated"
    assert t.num_workers * t.num_gpus <= shape["trainer_gpus"], "the trainer's ranks fit the stated node"
    for name, (types, started) in cluster_node_types().items():
        trainer, generator = types["trainer"]["resources"], types["generator"]["resources"]
        assert trainer["GPU"] == shape["trainer_gpus"] and generator["GPU"] == shape["generator_gpus"], name
        per_node = generator["generator"] // g.tensor_parallel_size  # replicas one generator node holds
        assert g.replica_bounds[1] == shape["generators"] * per_node, f"{name}: replicas vs stated nodes"
        assert g.num_gpus * per_node <= generator["GPU"] and t.num_workers * t.num_cpus <= trainer["CPU"], (
            name
        )
        for group, count in (("trainer", shape["trainers"]), ("generator", shape["generators"])):
            assert types[group]["min_workers"] <= count <= types[group]["max_workers"], (name, group)
        if name != "cluster.yaml":  # KubeRay starts the groups at `replicas`: the stated shape at once
            assert started == {"trainer": shape["trainers"], "generator": shape["generators"]}, name
        # What the run asks Ray for (rl_cluster.connection.placement_requests; the proxy goes on the head).
        requests = [
            Request(
                "trainer",
                {
                    "trainer": t.num_workers,
                    "CPU": t.num_workers * t.num_cpus,
                    "GPU": t.num_workers * t.num_gpus,
                },
            ),  # its ranks, on one node
            Request("generator", {"generator": g.tensor_parallel_size, "GPU": g.num_gpus}),
        ]
        assert unplaceable(requests, {}, [types[n]["resources"] for n in GROUPS]) == {}, name


def train_commands() -> dict[str, list[str]]:
    """{where: argv after `python`} of every shipped command that starts a GPU run: the RayJob's entrypoint,
    and the `ray job submit` lines of the cluster files' headers, the recipes' and the docs."""
    found = {"rayjob.yaml entrypoint": shlex.split(load(KUBERAY / "rayjob.yaml")["spec"]["entrypoint"])[1:]}
    texts = [CLUSTER_YAML, KUBERAY / "raycluster.yaml", *RECIPES, REPO / "docs/cluster.md"]
    for path in texts:
        text = re.sub(r"\\\n#?\s*", " ", path.read_text())  # a command's continuation lines, in a comment too
        matches = [m for m in TRAIN.finditer(text) if "--config" in m["args"]]  # not an elided `...` one
        for i, match in enumerate(matches):
            found[f"{path.name} #{i}"] = [match["script"], *shlex.split(match["args"])]
    return found


@pytest.mark.parametrize("where", sorted(train_commands()))
def test_every_shipped_run_command_starts_a_recipe_whose_data_the_run_prepares(where):
    """Each command runs jobs/train_grpo.py on a shipped recipe, as a new run (no --resume): its preflight
    then prepares the dataset when the bucket lacks it (tests/unit/test_data.py), so no step is needed
    before it, which a RayJob could not have. The bucket is the one every node mounts."""
    from rl_cluster.config import load_config

    script, *args = train_commands()[where]
    assert script.endswith("jobs/train_grpo.py") and "--resume" not in args, where
    config_path = args[args.index("--config") + 1]
    recipe = REPO / config_path.removeprefix(dockerfile_args("WORKDIR")[-1] + "/")
    assert recipe in RECIPES, f"{where}: {config_path} is not a shipped GPU recipe"
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    config = load_config(recipe, overrides)
    assert config.task.prompts == "dataset" and config.bucket.uri == BUCKET_PATH, where
    assert config.trainer.checkpoint_every > 0, where
