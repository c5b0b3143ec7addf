"""The bucket protocol against real directories and a real S3 API (moto's server on loopback).

Most tests run on both backends (`bucket`), and those about the commit rule on both kinds of published
directory (`kind`: adapter versions and checkpoints), since the rule is one for all of them.
"""

import json
import os
import pickle
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import S3_ENV, free_port, moto_s3

from rl_cluster.bucket import Bucket, apply_cache_retention, directory
from rl_cluster.bucket.layout import checkpoint_rel
from rl_cluster.core.manifest import AdapterMeta, base_model_fingerprint
from rl_cluster.errors import AdapterNotFound, AdapterRejected, BucketUnavailable

S3_BUCKET = "rl-test"
RUN = "run1"
TINY = {"model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 256, "vocab_size": 64}  # fmt: skip
FP = base_model_fingerprint(TINY)
FAST_RETRY = dict(attempts=3, retry_base_delay_s=0.01, retry_max_delay_s=0.05)


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on a free loopback port, with one bucket; killed after the module."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in S3_ENV.items():
            mp.setenv(key, value)
        with moto_s3(S3_BUCKET) as endpoint:
            yield endpoint


@pytest.fixture
def fs_bucket(tmp_path):
    return Bucket(str(tmp_path / "bucket"), **FAST_RETRY)


@pytest.fixture
def s3_bucket(s3_endpoint):
    return Bucket(f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:8]}", s3_endpoint, **FAST_RETRY)


@pytest.fixture(params=["fs", "s3"])
def bucket(request):
    return request.getfixturevalue(f"{request.param}_bucket")


def weights_of(version: int, size: int = 4096) -> bytes:
    return random.Random(version).randbytes(size)


def flipped(data: bytes) -> bytes:
    return bytes([data[0] ^ 1]) + data[1:]


def make_adapter(directory: Path, version: int = 1, rank: int = 1) -> Path:
    """A PEFT-shaped adapter directory (the protocol never parses the weights, so random bytes do)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj"],
        "base_model_name_or_path": "tiny",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    (directory / "adapter_model.safetensors").write_bytes(weights_of(version))
    return directory


def make_checkpoint(directory: Path, step: int, extra: bool = False) -> Path:
    """A flat HF Trainer checkpoint directory of a PEFT model (contents derived from `step`)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "adapter_model.safetensors": weights_of(step, 2048),
        "adapter_config.json": json.dumps({"r": 1, "target_modules": ["q_proj"]}).encode(),
        "optimizer.pt": weights_of(10_000 + step, 4096),
        "scheduler.pt": weights_of(20_000 + step, 100),
        "rng_state.pth": weights_of(30_000 + step, 200),
        "trainer_state.json": json.dumps({"global_step": step}).encode(),
        "rollout_state.json": json.dumps({"prompt_index": 4 * step, "model_version": step}).encode(),
    }
    if extra:
        files |= {"training_args.bin": b"args", "README.md": b"# checkpoint\n"}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def publish(bucket: Bucket, version: int, src: Path, rank: int = 1, name: str = "policy") -> str:
    meta = AdapterMeta(base_model="tiny", base_fingerprint=FP, rank=rank, alpha=2.0 * rank,
                       target_modules=["q_proj"], trainer_step=10 * version)  # fmt: skip
    return bucket.publish_adapter(RUN, name, version, src, meta)


def publish_checkpoint(bucket: Bucket, step: int, src: Path) -> str:
    return bucket.publish_checkpoint(RUN, step, src, base_model="tiny", base_fingerprint=FP)


def fetch(bucket: Bucket, uri: str, cache: Path, fingerprint: str = FP, max_rank: int = 8) -> Path:
    return bucket.fetch_verified(uri, cache_dir=cache, base_fingerprint=fingerprint, max_lora_rank=max_rank)


@dataclass(frozen=True)
class Kind:
    """How these tests make, publish, list and fetch one kind of published directory."""

    subdir: str
    noun: str  # as messages name it
    article: str
    dir_name: Callable[[int], str]
    make: Callable[[Path, int], Path]  # a source directory whose contents derive from N
    publish: Callable[[Bucket, int, Path], str]
    uri: Callable[[Bucket, int], str]
    listed: Callable[[Bucket], list[int]]
    fetch: Callable[[Bucket, str, Path], Path]


ADAPTERS = Kind("adapters", "version", "an adapter", lambda n: f"policy-v{n}", make_adapter, publish,
                lambda b, n: b.adapter_uri(RUN, "policy", n), lambda b: b.list_versions(RUN, "policy"), fetch)  # fmt: skip
CHECKPOINTS = Kind("checkpoints", "checkpoint", "a checkpoint", lambda n: f"step-{n}", make_checkpoint,
                   publish_checkpoint, lambda b, n: b.checkpoint_uri(RUN, n), lambda b: b.list_checkpoints(RUN),
                   lambda b, uri, cache: b.fetch_checkpoint(uri, cache_dir=cache))  # fmt: skip


@pytest.fixture(params=[ADAPTERS, CHECKPOINTS], ids=["adapter", "checkpoint"])
def kind(request):
    return request.param


def put(bucket: Bucket, uri: str, name: str, data: bytes | None) -> None:
    """Change a file of a published directory behind the protocol's back (None deletes it)."""
    if bucket.is_remote:
        path = f"{uri.removeprefix('s3://')}/{name}"
        bucket.store.fs.rm_file(path) if data is None else bucket.store.fs.pipe_file(path, data)
    else:
        path = Path(uri) / name
        path.unlink() if data is None else path.write_bytes(data)


def files_in(reading: Bucket, uri: str) -> set[str]:
    """What a published directory holds right now, straight from the medium."""
    if reading.is_remote:
        return {key.rsplit("/", 1)[1] for key in reading.store.fs.find(uri.removeprefix("s3://"))}
    return set(os.listdir(uri)) if os.path.isdir(uri) else set()


def cached(cache: Path, subdir: str = "adapters") -> list[str]:
    """What a local cache holds of the run's adapters (or checkpoints), temporaries included."""
    return sorted(os.listdir(cache / RUN / subdir)) if (cache / RUN / subdir).exists() else []


def test_publish_and_fetch_round_trip(bucket, tmp_path):
    src = make_adapter(tmp_path / "src", version=1)
    uri = publish(bucket, 1, src)
    assert uri == bucket.adapter_uri(RUN, "policy", 1)
    assert uri.endswith(f"{RUN}/adapters/policy-v1")
    assert bucket.list_versions(RUN, "policy") == [1]
    assert bucket.list_versions(RUN, "other") == []
    assert bucket.list_versions("no-such-run", "policy") == []

    local = fetch(bucket, uri, tmp_path / "cache")
    assert (local / "adapter_model.safetensors").read_bytes() == weights_of(1)
    assert (local / "adapter_config.json").read_bytes() == (src / "adapter_config.json").read_bytes()
    # Either backend: a verified copy in the cache, which has the bucket's layout.
    assert local == (tmp_path / "cache" / RUN / "adapters" / "policy-v1").resolve()
    assert fetch(bucket, uri, tmp_path / "cache") == local  # second time from the verified cache
    assert [p.name for p in local.parent.iterdir()] == ["policy-v1"]  # no temporaries left
    if not bucket.is_remote:
        assert [p.name for p in Path(uri).parent.iterdir()] == ["policy-v1"]
    manifest = json.loads((local / "manifest.json").read_text())
    assert manifest["version"] == 1 and manifest["trainer_step"] == 10 and manifest["rank"] == 1
    assert manifest["files"]["adapter_model.safetensors"]["size"] == 4096

    with pytest.raises(FileExistsError, match="already published; adapter names are never reused"):
        publish(bucket, 1, src)


def test_checkpoint_round_trip(bucket, tmp_path):
    src = make_checkpoint(tmp_path / "checkpoint-5", 5, extra=True)
    uri = publish_checkpoint(bucket, 5, src)
    assert uri == bucket.checkpoint_uri(RUN, 5) and uri.endswith(f"{RUN}/checkpoints/step-5")
    assert bucket.list_checkpoints(RUN) == [5]
    assert bucket.list_checkpoints("no-such-run") == []
    assert bucket.list_versions(RUN, "policy") == []  # checkpoints are not adapter versions

    cache = tmp_path / "cache"
    local = bucket.fetch_checkpoint(uri, cache_dir=cache, base_fingerprint=FP)
    assert sorted(os.listdir(local)) == sorted([*os.listdir(src), "manifest.json"])
    for name in os.listdir(src):
        assert (local / name).read_bytes() == (src / name).read_bytes(), name
    manifest = json.loads((local / "manifest.json").read_text())
    assert (manifest["kind"], manifest["name"], manifest["step"]) == ("checkpoint", "step-5", 5)
    assert manifest["base_model"] == "tiny" and manifest["base_model_fingerprint"] == FP
    assert (
        set(manifest["files"]) == set(os.listdir(src)) and manifest["files"]["optimizer.pt"]["size"] == 4096
    )
    if bucket.is_remote:
        assert local == (cache / RUN / "checkpoints" / "step-5").resolve()
        assert bucket.fetch_checkpoint(uri, cache_dir=cache) == local  # again, from the verified cache
    else:
        assert local == Path(uri).resolve()
        assert not cache.exists()  # verified in place
        assert os.listdir(Path(uri).parent) == ["step-5"]  # no temporaries left

    with pytest.raises(FileExistsError, match="already published; checkpoints are never overwritten"):
        publish_checkpoint(bucket, 5, make_checkpoint(tmp_path / "other", 6))
    assert bucket.fetch_checkpoint(uri, cache_dir=cache) == local  # still the first one
    assert (local / "optimizer.pt").read_bytes() == weights_of(10_005, 4096)

    other = base_model_fingerprint({**TINY, "hidden_size": 256})
    with pytest.raises(AdapterRejected, match=r"^step-5: trained on base model 'tiny' .* this trainer uses"):
        bucket.fetch_checkpoint(uri, cache_dir=tmp_path / "cache2", base_fingerprint=other)
    # Each kind's reader refuses the other kind's directories.
    with pytest.raises(
        AdapterRejected, match=r"not a version directory .*expected <run>/adapters/<name>-v<N>"
    ):
        fetch(bucket, uri, cache)
    adapter = publish(bucket, 1, make_adapter(tmp_path / "adapter"))
    with pytest.raises(
        AdapterRejected, match=r"not a checkpoint directory .*expected <run>/checkpoints/step-<N>"
    ):
        bucket.fetch_checkpoint(adapter, cache_dir=cache)


def test_a_damaged_checkpoint_is_quarantined_and_resume_falls_back(bucket, tmp_path, capsys):
    """The trainer's resume meets a newest checkpoint whose optimizer state changed after it was published:
    it is moved out of checkpoints/ (no listing, no retention count), the one before is used, and the step
    can be published again when the resumed run reaches it."""
    from rl_cluster.errors import FilesDiffer
    from rl_cluster.trainer.checkpoints import newest_checkpoint

    for step in (4, 8):
        publish_checkpoint(bucket, step, make_checkpoint(tmp_path / f"checkpoint-{step}", step))
    damaged = f"{checkpoint_rel(RUN, 8)}/optimizer.pt"
    bucket.store.write(damaged, flipped(bucket.store.read(damaged)))
    with pytest.raises(FilesDiffer, match="optimizer.pt: sha256"):
        bucket.fetch_checkpoint(bucket.checkpoint_uri(RUN, 8), cache_dir=tmp_path / "probe")

    config = SimpleNamespace(run_name=RUN, bucket=SimpleNamespace(cache_dir=str(tmp_path / "cache")))
    local, step = newest_checkpoint(bucket, config, FP, required=True)
    assert step == 4 and (Path(local) / "optimizer.pt").read_bytes() == weights_of(10_004, 4096)
    out = capsys.readouterr().out
    assert "checkpoint step 8 is damaged (optimizer.pt: sha256" in out and f"/{RUN}/quarantine/step-8-" in out
    assert bucket.list_checkpoints(RUN) == [4]
    assert bucket.apply_checkpoint_retention(RUN, keep_last=1) == []  # the damaged one counts for nothing
    publish_checkpoint(bucket, 8, make_checkpoint(tmp_path / "again-8", 8))  # no FileExistsError
    assert bucket.list_checkpoints(RUN) == [4, 8]

    # A checkpoint of another base model is skipped, not moved: the config may be what is wrong.
    other = base_model_fingerprint({**TINY, "hidden_size": 256})
    with pytest.raises(RuntimeError, match="holds no verified checkpoint"):
        newest_checkpoint(bucket, config, other, required=True)
    assert bucket.list_checkpoints(RUN) == [4, 8]


def test_run_files_are_written_whole(bucket):
    uri = bucket.write_text(RUN, "config.resolved.json", '{"a": 1}')
    bucket.write_text(RUN, "config.resolved.json", '{"a": 2}')
    bucket.write_bytes(RUN, "plots/curves.png", b"\x89PNG")
    assert uri == f"{bucket.run_uri(RUN)}/config.resolved.json"
    assert bucket.read_text(RUN, "config.resolved.json") == '{"a": 2}'
    assert bucket.read_bytes(RUN, "plots/curves.png") == b"\x89PNG"
    if not bucket.is_remote:
        assert sorted(os.listdir(bucket.run_uri(RUN))) == ["config.resolved.json", "plots"]
    with pytest.raises(FileNotFoundError):
        bucket.read_text(RUN, "missing.json")
    with pytest.raises(ValueError, match="without '..'"):
        bucket.write_text(RUN, "../escape.json", "{}")
    with pytest.raises(ValueError, match="plain name"):
        bucket.write_text("../up", "x.json", "{}")


@pytest.mark.parametrize(
    "kind, name, data, error, message",
    [
        (ADAPTERS, "adapter_model.safetensors", weights_of(5)[:1000], AdapterRejected,
         r"^adapter_model.safetensors: size 1000 != manifest 4096 \(truncated or still uploading\?\)$"),
        (ADAPTERS, "adapter_model.safetensors", flipped(weights_of(5)), AdapterRejected,
         r"^adapter_model.safetensors: sha256 \w+… != manifest \w+… \(corrupted or overwritten\?\)$"),
        (ADAPTERS, "adapter_config.json", None, AdapterRejected,
         r"^adapter_config.json: listed in the manifest but missing$"),
        (ADAPTERS, "manifest.json", None, AdapterNotFound, r"^policy-v5: no manifest.json at "),
        (ADAPTERS, "manifest.json", b'{"version": 5,', AdapterRejected, r"^policy-v5/manifest.json: not valid JSON"),
        (CHECKPOINTS, "optimizer.pt", weights_of(10_005, 4096)[:1000], AdapterRejected,
         r"^optimizer.pt: size 1000 != manifest 4096 \(truncated or still uploading\?\)$"),
        (CHECKPOINTS, "scheduler.pt", flipped(weights_of(20_005, 100)), AdapterRejected,
         r"^scheduler.pt: sha256 \w+… != manifest \w+… \(corrupted or overwritten\?\)$"),
        (CHECKPOINTS, "rng_state.pth", None, AdapterRejected, r"^rng_state.pth: listed in the manifest but missing$"),
        (CHECKPOINTS, "manifest.json", None, AdapterNotFound, r"^step-5: no manifest.json at "),
        (CHECKPOINTS, "manifest.json", b'{"step": 5,', AdapterRejected, r"^step-5/manifest.json: not valid JSON"),
    ],
    ids=["adapter-truncated", "adapter-flipped-byte", "adapter-file-missing", "adapter-manifest-missing",
         "adapter-manifest-garbled", "checkpoint-truncated", "checkpoint-flipped-byte", "checkpoint-file-missing",
         "checkpoint-manifest-missing", "checkpoint-manifest-garbled"],
)  # fmt: skip
def test_tampered_directory_is_refused_with_its_own_message(
    bucket, tmp_path, kind, name, data, error, message
):
    uri = kind.publish(bucket, 5, kind.make(tmp_path / "src", 5))
    put(bucket, uri, name, data)
    with pytest.raises(error, match=message):
        kind.fetch(bucket, uri, tmp_path / "cache")
    assert cached(tmp_path / "cache", kind.subdir) == []  # nothing (not even a temporary) left in the cache
    if name == "manifest.json" and data is None:
        assert kind.listed(bucket) == []  # without a manifest the directory does not exist


def test_incompatible_version_is_refused(bucket, tmp_path):
    uri = publish(bucket, 1, make_adapter(tmp_path / "src"))
    other = base_model_fingerprint({**TINY, "hidden_size": 256})
    with pytest.raises(AdapterRejected, match=r"^policy-v1: trained on base model 'tiny' \(fingerprint \w+…\), but "
                       r"this replica serves a model with fingerprint \w+…$"):  # fmt: skip
        fetch(bucket, uri, tmp_path / "cache", fingerprint=other)
    big = publish(bucket, 2, make_adapter(tmp_path / "src16", rank=16), rank=16)
    with pytest.raises(AdapterRejected, match=r"^policy-v2: rank 16 exceeds this replica's max LoRA rank 8$"):
        fetch(bucket, big, tmp_path / "cache", max_rank=8)
    assert cached(tmp_path / "cache") == []  # refused before anything was downloaded
    assert fetch(bucket, big, tmp_path / "cache", max_rank=16).name == "policy-v2"


def test_corrupted_cache_copy_is_fetched_again(s3_bucket, kind, tmp_path):
    uri = kind.publish(s3_bucket, 1, kind.make(tmp_path / "src", 1))
    local = kind.fetch(s3_bucket, uri, tmp_path / "cache")
    (local / "adapter_model.safetensors").write_bytes(b"garbage")
    again = kind.fetch(s3_bucket, uri, tmp_path / "cache")
    assert again == local
    assert (again / "adapter_model.safetensors").read_bytes() == (tmp_path / "src" / "adapter_model.safetensors").read_bytes()  # fmt: skip


def test_paths_outside_the_bucket_are_refused(fs_bucket, kind, tmp_path):
    uri = Path(kind.publish(fs_bucket, 1, kind.make(tmp_path / "s1", 1)))
    parent = uri.parent
    elsewhere = Bucket(str(tmp_path / "elsewhere"))
    outside = Path(
        kind.publish(elsewhere, 2, kind.make(tmp_path / "s2", 2))
    )  # complete and valid, but elsewhere

    def refused(path, message):
        with pytest.raises(AdapterRejected, match=message):
            kind.fetch(fs_bucket, str(path), tmp_path / "cache")

    refused(f"{parent}/../{kind.subdir}/{uri.name}", rf"'\.\.' in {kind.article} path is refused")
    refused(outside, r"resolves to .*elsewhere.*, outside the bucket root")
    (parent / outside.name).symlink_to(outside, target_is_directory=True)  # a link out of the bucket
    refused(parent / outside.name, rf"{outside.name}: resolves to .*elsewhere.*, outside the bucket root")
    (parent.parent.parent / "linked").symlink_to(
        outside.parent.parent, target_is_directory=True
    )  # a run, linked
    refused(parent.parent.parent / "linked" / kind.subdir / outside.name, r"outside the bucket root")

    # A directory inside the bucket whose weights file links out (same bytes, so the hash would pass).
    src = kind.make(tmp_path / "s3", 3)
    inside, twin = Path(kind.publish(fs_bucket, 3, src)), Path(kind.publish(elsewhere, 3, src))
    (inside / "adapter_model.safetensors").unlink()
    (inside / "adapter_model.safetensors").symlink_to(twin / "adapter_model.safetensors")
    refused(inside, r"^adapter_model.safetensors: resolves to .*elsewhere.*, outside the bucket root")

    # A link inside the bucket that renames a directory: served under the new name, it would be a reused name.
    renamed = parent / kind.dir_name(4)
    renamed.symlink_to(uri, target_is_directory=True)
    refused(
        renamed,
        rf"^{renamed.name}: manifest describes '{uri.name}' \(copied or renamed {kind.noun} directory",
    )
    refused(parent.parent, rf"not a {kind.noun} directory")
    assert kind.listed(fs_bucket) == [1, 2, 3, 4]  # links are listed; a fetch is where they are refused
    # An adapter is served from the copy it was checked in; a checkpoint is read in place.
    copied = (tmp_path / "cache" / RUN / kind.subdir / uri.name).resolve()
    assert kind.fetch(fs_bucket, str(uri), tmp_path / "cache") == (
        copied if kind is ADAPTERS else uri.resolve()
    )


def test_an_adapter_is_served_from_the_copy_it_was_verified_in(fs_bucket, tmp_path):
    """A writer to a directory bucket who swaps a file after the check changes nothing vLLM reads: the
    replica verified a node-local copy, and loads (and, after an eviction, re-reads) that copy."""
    src = make_adapter(tmp_path / "src")
    uri = publish(fs_bucket, 1, src)
    local = fetch(fs_bucket, uri, tmp_path / "cache")
    assert local.is_relative_to((tmp_path / "cache").resolve())
    assert not local.is_relative_to(Path(fs_bucket.uri).resolve())
    weights = (src / "adapter_model.safetensors").read_bytes()
    put(fs_bucket, uri, "adapter_model.safetensors", b"swapped after the check")
    assert (local / "adapter_model.safetensors").read_bytes() == weights
    assert fetch(fs_bucket, uri, tmp_path / "cache") == local  # the copy, checked again, still stands


def test_s3_uris_outside_the_bucket_are_refused(s3_bucket, tmp_path):
    uri = publish(s3_bucket, 1, make_adapter(tmp_path / "src"))
    root = s3_bucket.uri

    def refused(version_uri, message):
        with pytest.raises(AdapterRejected, match=message):
            fetch(s3_bucket, version_uri, tmp_path / "cache")

    refused(f"{root}/{RUN}/adapters/../adapters/policy-v1", r"'\.\.' path segments are refused")
    refused(f"{root}/{RUN}/adapters//policy-v1", r"empty, '\.' or '\.\.' path segments")
    refused(f"s3://{S3_BUCKET}/other/{RUN}/adapters/policy-v1", r"outside the bucket root")
    refused(f"{root}-x/{RUN}/adapters/policy-v1", r"outside the bucket root")
    refused(uri.removeprefix("s3://"), r"not an s3:// URI")
    refused(f"{root}/{RUN}/policy-v1", r"not a version directory")
    assert cached(tmp_path / "cache") == []


def test_reader_never_sees_a_partial_directory(bucket, kind, tmp_path):
    """A reader polling while directories are published only ever gets complete, matching ones. What a
    listed directory holds is checked the moment it is listed: a fetch reads files in the writer's order
    at about its speed, which would hide a manifest written early."""
    # Checkpoints have more files, so fewer of them keep the test short; on s3 (moto), where one publication
    # takes ~0.1 s, half as many (200 adapters took 21 s of `make test-fast`'s two minutes).
    n = (200 if kind is ADAPTERS else 30) // (2 if bucket.s3_endpoint_url else 1)
    writer_done = threading.Event()
    seen: list[int] = []
    not_found = 0
    errors: list[BaseException] = []

    def source(i: int) -> Path:
        return tmp_path / "src" / str(i)

    def read(reading: Bucket, i: int) -> None:
        local = kind.fetch(reading, kind.uri(reading, i), tmp_path / "cache")
        for name in os.listdir(source(i)):
            assert (local / name).read_bytes() == (source(i) / name).read_bytes(), (i, name)
        seen.append(i)

    def reader():
        nonlocal not_found
        reading = Bucket(bucket.uri, bucket.s3_endpoint_url, **FAST_RETRY)  # its own client, like a replica
        try:
            while True:
                last_round = writer_done.is_set()
                latest = seen[-1] if seen else 0
                listed = [i for i in kind.listed(reading) if i > latest]
                if listed:  # listed means complete: every file there at once, and it must verify
                    files = files_in(reading, kind.uri(reading, listed[-1]))
                    assert files >= {*os.listdir(source(listed[-1])), "manifest.json"}, listed[-1]
                    read(reading, listed[-1])
                try:  # the one probably being written right now: complete, or not there at all
                    read(reading, max(listed, default=latest) + 1)
                except AdapterNotFound:
                    not_found += 1
                if last_round:
                    return
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    started = time.monotonic()
    try:
        for i in range(1, n + 1):
            kind.publish(bucket, i, kind.make(source(i), i))
    finally:
        writer_done.set()
        thread.join(60)
    print(f"{n} in {time.monotonic() - started:.1f}s; reader verified {len(seen)}, not found {not_found}")
    assert not errors, errors[0]
    assert kind.listed(bucket) == list(range(1, n + 1))
    assert seen[-1] == n and len(seen) >= 5, seen  # the reader really ran alongside the writer


def test_unreachable_bucket_fails_fast_and_clearly(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    down = Bucket(f"s3://{S3_BUCKET}/x", closed, attempts=3, retry_base_delay_s=0.01, s3_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(BucketUnavailable, match=rf"^bucket s3://{S3_BUCKET}/x unreachable: list .* failed 3 times "
                       r"in [\d.]+s; last error: \w+"):  # fmt: skip
        down.list_versions(RUN, "policy")
    with pytest.raises(BucketUnavailable, match=r"unreachable: check .*manifest.json failed 3 times"):
        publish(down, 1, make_adapter(tmp_path / "src"))
    with pytest.raises(
        BucketUnavailable, match=r"unreachable: read .*policy-v1/manifest.json failed 3 times"
    ):
        fetch(down, down.adapter_uri(RUN, "policy", 1), tmp_path / "cache")
    assert time.monotonic() - started < 10
    assert cached(tmp_path / "cache") == []


def test_failed_publication_leaves_nothing_a_reader_could_take(bucket, kind, tmp_path, monkeypatch):
    kind.publish(bucket, 1, kind.make(tmp_path / "s1", 1))
    src = kind.make(tmp_path / "s2", 2)
    failures = []

    def flaky(*args, **kwargs):  # the bucket stops answering just before the commit
        failures.append(args)
        raise ConnectionError("connection reset by peer")

    if bucket.is_remote:  # the commit is the manifest's conditional PUT
        real_put = bucket.store._put
        monkeypatch.setattr(bucket.store, "_put", lambda key, data, **kw: (flaky if key.endswith(
            "manifest.json") else real_put)(key, data, **kw))  # fmt: skip
    else:
        real_write = directory.write_synced
        monkeypatch.setattr(directory, "write_synced", lambda path, data: (flaky if path.name == (
            "manifest.json") else real_write)(path, data))  # fmt: skip
    with pytest.raises(BucketUnavailable, match=rf"unreachable: (commit|publish) .*{kind.dir_name(2)}.* failed 3 "
                       r"times.*ConnectionError: connection reset by peer"):  # fmt: skip
        kind.publish(bucket, 2, src)
    assert len(failures) == 3
    monkeypatch.undo()
    assert kind.listed(bucket) == [1]
    with pytest.raises(AdapterNotFound):
        kind.fetch(bucket, kind.uri(bucket, 2), tmp_path / "cache")
    assert files_in(bucket, kind.uri(bucket, 2)) == set()  # the uploaded files were removed too
    if not bucket.is_remote:  # no temporary directory left behind
        assert os.listdir(Path(bucket.run_uri(RUN)) / kind.subdir) == [kind.dir_name(1)]
    kind.publish(bucket, 2, src)  # the name was never published, so it is free
    assert kind.listed(bucket) == [1, 2]


def assert_gone(bucket: Bucket, uri: str) -> None:
    """Deleted entirely, not only its manifest."""
    assert files_in(bucket, uri) == set()
    assert bucket.is_remote or not Path(uri).exists()


def test_retention_deletes_old_versions_but_keeps_protected_ones(bucket, tmp_path):
    src = make_adapter(tmp_path / "src")
    for v in range(1, 11):
        publish(bucket, v, src)
    publish(bucket, 1, src, name="value")  # another adapter of the run is not touched
    deleted = bucket.apply_retention(RUN, "policy", live_window=3, keep_every=4, protected={2})
    assert deleted == [1, 3, 5, 6, 7]
    assert bucket.list_versions(RUN, "policy") == [2, 4, 8, 9, 10]
    assert bucket.list_versions(RUN, "value") == [1]
    for v in deleted:
        assert_gone(bucket, bucket.adapter_uri(RUN, "policy", v))
    assert bucket.apply_retention(RUN, "policy", live_window=3, keep_every=4, protected={2}) == []
    assert bucket.apply_retention(RUN, "policy", live_window=1, keep_every=0, protected=set()) == [2, 4, 8, 9]


def test_checkpoint_retention_keeps_the_newest(bucket, tmp_path):
    for step in (10, 20, 30, 40, 50):
        publish_checkpoint(bucket, step, make_checkpoint(tmp_path / f"checkpoint-{step}", step))
    publish(bucket, 1, make_adapter(tmp_path / "adapter"))  # adapters are not touched
    with pytest.raises(ValueError, match="keep_last=0 must be an int >= 1"):
        bucket.apply_checkpoint_retention(RUN, keep_last=0)
    assert bucket.apply_checkpoint_retention(RUN, keep_last=2) == [10, 20, 30]
    assert bucket.list_checkpoints(RUN) == [40, 50]
    assert bucket.list_versions(RUN, "policy") == [1]
    for step in (10, 20, 30):
        assert_gone(bucket, bucket.checkpoint_uri(RUN, step))
    assert bucket.apply_checkpoint_retention(RUN, keep_last=2) == []
    assert bucket.apply_checkpoint_retention(RUN, keep_last=1) == [40]
    local = bucket.fetch_checkpoint(bucket.checkpoint_uri(RUN, 50), cache_dir=tmp_path / "cache")
    assert (local / "trainer_state.json").read_text() == '{"global_step": 50}'


def test_cache_retention(s3_bucket, tmp_path):
    src = make_adapter(tmp_path / "src")
    cache = tmp_path / "cache"
    for v in range(1, 7):
        fetch(s3_bucket, publish(s3_bucket, v, src), cache)
    (cache / RUN / "adapters" / ".policy-v7.tmp-abcd").mkdir()  # a download in progress is not a version
    deleted = apply_cache_retention(cache, RUN, "policy", live_window=2, keep_every=2, protected={1})
    assert deleted == [3]
    assert cached(cache) == [
        ".policy-v7.tmp-abcd",
        "policy-v1",
        "policy-v2",
        "policy-v4",
        "policy-v5",
        "policy-v6",
    ]
    assert (
        apply_cache_retention(cache / "missing", RUN, "policy", live_window=1, keep_every=0, protected=())
        == []
    )


def test_bucket_survives_pickling(s3_bucket, tmp_path):
    """Buckets travel to Ray actors; each copy makes its own S3 client."""
    publish(s3_bucket, 1, make_adapter(tmp_path / "src"))
    copy = pickle.loads(pickle.dumps(s3_bucket))
    assert copy.list_versions(RUN, "policy") == [1]
    assert copy.store.fs is not s3_bucket.store.fs


def test_checkpoint_source_must_be_a_flat_trainer_checkpoint(fs_bucket, tmp_path):
    src = make_checkpoint(tmp_path / "src", 1)
    (src / "global_step1").mkdir()
    with pytest.raises(ValueError, match=r"only plain files can be published, found \['global_step1'\]"):
        publish_checkpoint(fs_bucket, 1, src)
    (src / "global_step1").rmdir()
    (src / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match="lacks trainer_state.json; is it a HF Trainer checkpoint directory"):
        publish_checkpoint(fs_bucket, 1, src)
    with pytest.raises(ValueError, match=r"step=-1 must be an int >= 0"):
        publish_checkpoint(fs_bucket, -1, make_checkpoint(tmp_path / "ok", 1))
    assert fs_bucket.list_checkpoints(RUN) == []
    assert not (Path(fs_bucket.run_uri(RUN)) / "checkpoints").exists()


# -------------------------------------------------------------------- experience shards


def shard_parquet(tmp_path: Path, group_id: int) -> Path:
    """A one-row experience shard file (rl_cluster.core.experience has the columns)."""
    import pyarrow.parquet as pq

    from rl_cluster.experience import rows_table

    row = {"segment": "seg1", "group_id": group_id, "model_version": 1, "adapter": "run1-v1", "trainer_version": 1,
           "staleness": 0, "trained": True, "prompt_ids": [1, 2], "completion_ids": [3, 70000], "completion_mask": [1, 1],
           "logprobs": [-0.25, -1.5], "reward": 1.0, "rewards": {"accuracy": 1.0}, "advantage": 0.5,
           "enqueued_at": None, "pulled_at": 2.0}  # fmt: skip
    path = tmp_path / f"any-name-{group_id}.parquet"
    pq.write_table(rows_table([row]), path)
    return path


def test_experience_shards_commit_list_and_read_back_verified(bucket, tmp_path):
    from rl_cluster.experience import load_experience

    for seq in range(3):
        uri = bucket.publish_experience_shard(
            RUN, seq, "seg1", shard_parquet(tmp_path, seq), rows=1, groups=1
        )
        assert uri == bucket.experience_shard_uri(RUN, seq, "seg1")
    bucket.publish_experience_shard(RUN, 0, "seg0", shard_parquet(tmp_path, 9), rows=1, groups=1)
    assert bucket.list_experience_shards(RUN) == [(0, "seg0"), (0, "seg1"), (1, "seg1"), (2, "seg1")]
    ds = load_experience(bucket, RUN, cache_dir=tmp_path / "cache")
    assert ds["group_id"] == [9, 0, 1, 2]
    assert ds[0]["completion_ids"] == [3, 70000] and ds[0]["rewards"] == {"accuracy": 1.0}
    with pytest.raises(FileExistsError, match="never reused"):
        bucket.publish_experience_shard(RUN, 0, "seg0", shard_parquet(tmp_path, 9), rows=1, groups=1)


def test_experience_shard_is_visible_only_with_its_manifest_and_only_as_published(bucket, tmp_path):
    from rl_cluster.experience import load_experience

    first, second = (
        bucket.publish_experience_shard(RUN, seq, "seg1", shard_parquet(tmp_path, seq), rows=1, groups=1)
        for seq in range(2)
    )
    put(bucket, first, "manifest.json", None)  # as if the writer died before its last write
    assert bucket.list_experience_shards(RUN) == [(1, "seg1")]
    with pytest.raises(AdapterNotFound):
        bucket.fetch_experience_shard(first, cache_dir=tmp_path / "cache")
    data = bucket.store.read(f"{RUN}/experience/shard-000001-seg1/rows.parquet")
    put(bucket, second, "rows.parquet", flipped(data))
    with pytest.raises(AdapterRejected, match=r"^rows\.parquet: sha256 \w+… != manifest \w+… \(corrupted"):
        load_experience(bucket, RUN, cache_dir=tmp_path / "cache")
    with pytest.raises(AdapterRejected, match="not a shard directory"):
        bucket.fetch_experience_shard(bucket.adapter_uri(RUN, "run1", 1), cache_dir=tmp_path / "cache")


def test_of_two_s3_writers_of_one_name_one_commits_and_the_other_is_told(s3_bucket, tmp_path, monkeypatch):
    """Both passed the check that the name is free (a HEAD: check-then-act) before either committed: the
    manifest's conditional PUT commits exactly one; the other gets FileExistsError and removes nothing of
    the version that is there (an unconditional PUT replaced the first writer's manifest)."""
    src = make_adapter(tmp_path / "first", 2)
    first = publish(s3_bucket, 2, src)
    before = s3_bucket.store.read(f"{RUN}/adapters/policy-v2/manifest.json")
    monkeypatch.setattr(s3_bucket.store, "_exists", lambda key: False)  # the second writer's HEAD was early
    with pytest.raises(FileExistsError, match="published by another writer while this one uploaded"):
        # Same files, another manifest (its trainer step): a second trainer of one run.
        s3_bucket.publish_adapter(RUN, "policy", 2, src, AdapterMeta(
            base_model="tiny", base_fingerprint=FP, rank=1, alpha=2, target_modules=["q_proj"], trainer_step=99))  # fmt: skip
    assert s3_bucket.store.read(f"{RUN}/adapters/policy-v2/manifest.json") == before
    assert (
        fetch(s3_bucket, first, tmp_path / "cache") / "adapter_model.safetensors"
    ).read_bytes() == weights_of(2)


def test_an_s3_commit_whose_answer_was_lost_is_found_committed(s3_bucket, tmp_path, monkeypatch):
    """The manifest's PUT lands, its answer does not, the retry is refused (If-None-Match): the bytes
    there are this writer's own, so the version is published."""
    real_put, lost = s3_bucket.store._put, []

    def put(key, data, **condition):
        etag = real_put(key, data, **condition)
        if key.endswith("manifest.json") and not lost:
            lost.append(key)
            raise ConnectionError("connection reset by peer")
        return etag

    monkeypatch.setattr(s3_bucket.store, "_put", put)
    uri = publish(s3_bucket, 3, make_adapter(tmp_path / "src", 3))
    assert lost and s3_bucket.list_versions(RUN, "policy") == [3]
    assert (
        fetch(s3_bucket, uri, tmp_path / "cache") / "adapter_model.safetensors"
    ).read_bytes() == weights_of(3)
