"""The bucket protocol against real directories and a real S3 API (moto's server on loopback)."""

import json
import os
import pickle
import random
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import S3_ENV, free_port, moto_s3

from rl_cluster import bucket as bucket_module
from rl_cluster.bucket import Bucket, apply_cache_retention
from rl_cluster.core.manifest import base_model_fingerprint
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


def publish(bucket: Bucket, version: int, src: Path, rank: int = 1, name: str = "policy") -> str:
    return bucket.publish_adapter(RUN, name, version, src, base_model="tiny", base_fingerprint=FP, rank=rank,
                                  alpha=2.0 * rank, target_modules=["q_proj"], trainer_step=10 * version)  # fmt: skip


def fetch(bucket: Bucket, uri: str, cache: Path, fingerprint: str = FP, max_rank: int = 8) -> Path:
    return bucket.fetch_verified(uri, cache_dir=cache, base_fingerprint=fingerprint, max_lora_rank=max_rank)


def put(bucket: Bucket, version_uri: str, name: str, data: bytes | None) -> None:
    """Change a file of a published version behind the protocol's back (None deletes it)."""
    if bucket.is_remote:
        path = f"{version_uri.removeprefix('s3://')}/{name}"
        bucket.s3.rm_file(path) if data is None else bucket.s3.pipe_file(path, data)
    else:
        path = Path(version_uri) / name
        path.unlink() if data is None else path.write_bytes(data)


def cache_entries(cache: Path) -> list[str]:
    return sorted(os.listdir(cache / RUN)) if (cache / RUN).exists() else []


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
    if bucket.is_remote:
        assert local == (tmp_path / "cache" / RUN / "policy-v1").absolute()
        assert fetch(bucket, uri, tmp_path / "cache") == local  # second time from the verified cache
    else:
        assert local == Path(uri).resolve()
        assert not (tmp_path / "cache").exists()  # verified in place, nothing copied
        assert [p.name for p in Path(uri).parent.iterdir()] == ["policy-v1"]  # no temporaries left
    manifest = json.loads((local / "manifest.json").read_text())
    assert manifest["version"] == 1 and manifest["trainer_step"] == 10 and manifest["rank"] == 1
    assert manifest["files"]["adapter_model.safetensors"]["size"] == 4096

    with pytest.raises(FileExistsError, match="never reused"):
        publish(bucket, 1, src)


def test_run_files_are_written_whole(bucket):
    uri = bucket.write_text(RUN, "config.resolved.json", '{"a": 1}')
    bucket.write_text(RUN, "config.resolved.json", '{"a": 2}')
    bucket.write_bytes(RUN, "plots/curves.png", b"\x89PNG")
    assert uri == f"{bucket.run_uri(RUN)}/config.resolved.json"
    assert bucket.read_text(RUN, "config.resolved.json") == '{"a": 2}'
    assert bucket.read_bytes(RUN, "plots/curves.png") == b"\x89PNG"
    if not bucket.is_remote:
        assert sorted(os.listdir(bucket.run_uri(RUN))) == ["config.resolved.json", "plots"]
    with pytest.raises(ValueError, match="without '..'"):
        bucket.write_text(RUN, "../escape.json", "{}")
    with pytest.raises(ValueError, match="plain name"):
        bucket.write_text("../up", "x.json", "{}")


@pytest.mark.parametrize(
    "name, data, error, message",
    [
        ("adapter_model.safetensors", weights_of(1)[:1000], AdapterRejected,
         r"^adapter_model.safetensors: size 1000 != manifest 4096 \(truncated or still uploading\?\)$"),
        ("adapter_model.safetensors", bytes([weights_of(1)[0] ^ 1]) + weights_of(1)[1:], AdapterRejected,
         r"^adapter_model.safetensors: sha256 \w+… != manifest \w+… \(corrupted or overwritten\?\)$"),
        ("adapter_config.json", None, AdapterRejected, r"^adapter_config.json: listed in the manifest but missing$"),
        ("manifest.json", None, AdapterNotFound, r"^policy-v1: no manifest.json (in|at) "),
        ("manifest.json", b'{"version": 1,', AdapterRejected, r"^policy-v1/manifest.json: not valid JSON"),
    ],
    ids=["truncated", "flipped-byte", "file-missing", "manifest-missing", "manifest-garbled"],
)  # fmt: skip
def test_tampered_version_is_refused_with_its_own_message(bucket, tmp_path, name, data, error, message):
    uri = publish(bucket, 1, make_adapter(tmp_path / "src"))
    put(bucket, uri, name, data)
    with pytest.raises(error, match=message):
        fetch(bucket, uri, tmp_path / "cache")
    assert cache_entries(tmp_path / "cache") == []  # nothing (not even a temporary) left in the cache
    if name == "manifest.json" and data is None:
        assert bucket.list_versions(RUN, "policy") == []  # without a manifest the version does not exist


def test_incompatible_version_is_refused(bucket, tmp_path):
    uri = publish(bucket, 1, make_adapter(tmp_path / "src"))
    other = base_model_fingerprint({**TINY, "hidden_size": 256})
    with pytest.raises(AdapterRejected, match=r"^policy-v1: trained on base model 'tiny' \(fingerprint \w+…\), but "
                       r"this replica serves a model with fingerprint \w+…$"):  # fmt: skip
        fetch(bucket, uri, tmp_path / "cache", fingerprint=other)
    big = publish(bucket, 2, make_adapter(tmp_path / "src16", rank=16), rank=16)
    with pytest.raises(AdapterRejected, match=r"^policy-v2: rank 16 exceeds this replica's max LoRA rank 8$"):
        fetch(bucket, big, tmp_path / "cache", max_rank=8)
    assert cache_entries(tmp_path / "cache") == []  # refused before anything was downloaded
    assert fetch(bucket, big, tmp_path / "cache", max_rank=16).name == "policy-v2"


def test_corrupted_cache_copy_is_fetched_again(s3_bucket, tmp_path):
    uri = publish(s3_bucket, 1, make_adapter(tmp_path / "src"))
    local = fetch(s3_bucket, uri, tmp_path / "cache")
    (local / "adapter_model.safetensors").write_bytes(b"garbage")
    again = fetch(s3_bucket, uri, tmp_path / "cache")
    assert again == local
    assert (again / "adapter_model.safetensors").read_bytes() == weights_of(1)


def test_paths_outside_the_bucket_are_refused(fs_bucket, tmp_path):
    src = make_adapter(tmp_path / "src")
    uri = Path(publish(fs_bucket, 1, src))
    adapters = uri.parent
    elsewhere = Bucket(str(tmp_path / "elsewhere"))
    outside = Path(publish(elsewhere, 1, src))  # a complete, valid version, but in another directory

    def refused(path, message):
        with pytest.raises(AdapterRejected, match=message):
            fetch(fs_bucket, str(path), tmp_path / "cache")

    refused(f"{adapters}/../adapters/policy-v1", r"'\.\.' in an adapter path is refused")
    refused(outside, r"resolves to .*elsewhere.*, outside the bucket root")
    (adapters / "policy-v2").symlink_to(outside, target_is_directory=True)  # a link out of the bucket
    refused(adapters / "policy-v2", r"policy-v2: resolves to .*elsewhere.*, outside the bucket root")
    (adapters.parent / "linked").symlink_to(outside.parent, target_is_directory=True)
    refused(adapters.parent / "linked" / "policy-v1", r"outside the bucket root")

    # A version inside the bucket whose weights file links out (same bytes, so the hash would pass).
    inside = adapters / "policy-v3"
    shutil.copytree(uri, inside)
    (inside / "manifest.json").write_text((uri / "manifest.json").read_text().replace("policy-v1", "policy-v3")
                                          .replace('"version": 1', '"version": 3'))  # fmt: skip
    (inside / "adapter_model.safetensors").unlink()
    (inside / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    refused(inside, r"^adapter_model.safetensors: resolves to .*elsewhere.*, outside the bucket root")

    # A link inside the bucket that renames a version: served under the new name, it would be a reused name.
    (adapters / "policy-v4").symlink_to(uri, target_is_directory=True)
    refused(adapters / "policy-v4", r"^policy-v4: manifest describes 'policy-v1'")
    refused(adapters.parent, r"not a version directory")
    assert fetch(fs_bucket, str(uri), tmp_path / "cache") == uri.resolve()


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
    assert cache_entries(tmp_path / "cache") == []


def files_in(reading: Bucket, uri: str) -> set[str]:
    """What a version or checkpoint directory holds right now. Checked the moment it is listed: a fetch
    reads files in the writer's order at about its speed, which would hide a manifest written early."""
    if reading.is_remote:
        return {key.rsplit("/", 1)[1] for key in reading.s3.find(uri.removeprefix("s3://"))}
    return set(os.listdir(uri))


def test_reader_never_sees_a_partial_version(bucket, tmp_path):
    """A reader polling while 200 versions are published only ever gets complete, matching versions."""
    n = 200
    src = make_adapter(tmp_path / "src")
    writer_done = threading.Event()
    seen: list[int] = []
    not_found = 0
    errors: list[BaseException] = []

    def read(reading: Bucket, version: int) -> None:
        local = fetch(reading, reading.adapter_uri(RUN, "policy", version), tmp_path / "cache")
        assert (local / "adapter_model.safetensors").read_bytes() == weights_of(version), version
        seen.append(version)

    def reader():
        nonlocal not_found
        reading = Bucket(bucket.uri, bucket.s3_endpoint_url, **FAST_RETRY)  # its own client, like a replica
        try:
            while True:
                last_round = writer_done.is_set()
                latest = seen[-1] if seen else 0
                listed = [v for v in reading.list_versions(RUN, "policy") if v > latest]
                if listed:  # listed means complete: every file there at once, and it must verify
                    uri = reading.adapter_uri(RUN, "policy", listed[-1])
                    assert files_in(reading, uri) >= {*os.listdir(src), "manifest.json"}, listed[-1]
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
        for v in range(1, n + 1):
            (src / "adapter_model.safetensors").write_bytes(weights_of(v))
            publish(bucket, v, src)
    finally:
        writer_done.set()
        thread.join(60)
    print(
        f"{n} versions in {time.monotonic() - started:.1f}s; reader verified {len(seen)}, not found {not_found}"
    )
    assert not errors, errors[0]
    assert bucket.list_versions(RUN, "policy") == list(range(1, n + 1))
    assert seen[-1] == n and len(seen) >= 10, seen  # the reader really ran alongside the writer


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
    assert cache_entries(tmp_path / "cache") == []


def test_failed_publication_leaves_nothing_a_reader_could_take(bucket, tmp_path, monkeypatch):
    src = make_adapter(tmp_path / "src")
    publish(bucket, 1, src)
    failures = []

    def flaky(*args, **kwargs):  # the bucket stops answering just before the commit
        failures.append(args)
        raise ConnectionError("connection reset by peer")

    if bucket.is_remote:
        real_pipe = bucket.s3.pipe_file
        monkeypatch.setattr(bucket.s3, "pipe_file", lambda path, data, **kw: (flaky if path.endswith(
            "manifest.json") else real_pipe)(path, data, **kw))  # fmt: skip
    else:
        real_write = bucket_module._write_synced
        monkeypatch.setattr(bucket_module, "_write_synced", lambda path, data: (flaky if path.name == (
            "manifest.json") else real_write)(path, data))  # fmt: skip
    with pytest.raises(BucketUnavailable, match=r"unreachable: (commit|publish) .*policy-v2.* failed 3 times.*"
                       r"ConnectionError: connection reset by peer"):  # fmt: skip
        publish(bucket, 2, src)
    assert len(failures) == 3
    monkeypatch.undo()
    assert bucket.list_versions(RUN, "policy") == [1]
    with pytest.raises(AdapterNotFound):
        fetch(bucket, bucket.adapter_uri(RUN, "policy", 2), tmp_path / "cache")
    if bucket.is_remote:  # the uploaded files were removed too
        assert bucket.s3.find(bucket.adapter_uri(RUN, "policy", 2).removeprefix("s3://")) == []
    else:  # no temporary directory left behind
        assert os.listdir(Path(bucket.run_uri(RUN)) / "adapters") == ["policy-v1"]
    publish(bucket, 2, src)  # the name was never published, so it is free
    assert bucket.list_versions(RUN, "policy") == [1, 2]


def test_retention_deletes_old_versions_but_keeps_protected_ones(bucket, tmp_path):
    src = make_adapter(tmp_path / "src")
    for v in range(1, 11):
        publish(bucket, v, src)
    publish(bucket, 1, src, name="value")  # another adapter of the run is not touched
    deleted = bucket.apply_retention(RUN, "policy", live_window=3, keep_every=4, protected={2})
    assert deleted == [1, 3, 5, 6, 7]
    assert bucket.list_versions(RUN, "policy") == [2, 4, 8, 9, 10]
    assert bucket.list_versions(RUN, "value") == [1]
    for v in deleted:  # gone entirely, not only their manifests
        path = bucket.adapter_uri(RUN, "policy", v)
        if bucket.is_remote:
            assert bucket.s3.find(path.removeprefix("s3://")) == []
        else:
            assert not Path(path).exists()
    assert bucket.apply_retention(RUN, "policy", live_window=3, keep_every=4, protected={2}) == []
    assert bucket.apply_retention(RUN, "policy", live_window=1, keep_every=0, protected=set()) == [2, 4, 8, 9]


def test_cache_retention(s3_bucket, tmp_path):
    src = make_adapter(tmp_path / "src")
    cache = tmp_path / "cache"
    for v in range(1, 7):
        fetch(s3_bucket, publish(s3_bucket, v, src), cache)
    (cache / RUN / ".policy-v7.tmp-abcd").mkdir()  # a download in progress is not a version
    deleted = apply_cache_retention(cache, RUN, "policy", live_window=2, keep_every=2, protected={1})
    assert deleted == [3]
    assert cache_entries(cache) == [".policy-v7.tmp-abcd", "policy-v1", "policy-v2", "policy-v4", "policy-v5",
                                    "policy-v6"]  # fmt: skip
    assert (
        apply_cache_retention(cache / "missing", RUN, "policy", live_window=1, keep_every=0, protected=())
        == []
    )


def test_bucket_survives_pickling(s3_bucket, tmp_path):
    """Buckets travel to Ray actors; each copy makes its own S3 client."""
    publish(s3_bucket, 1, make_adapter(tmp_path / "src"))
    copy = pickle.loads(pickle.dumps(s3_bucket))
    assert copy.list_versions(RUN, "policy") == [1]
    assert copy.s3 is not s3_bucket.s3


# -------------------------------------------------------------------- checkpoints


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


def publish_checkpoint(bucket: Bucket, step: int, src: Path) -> str:
    return bucket.publish_checkpoint(RUN, step, src, base_model="tiny", base_fingerprint=FP)


def checkpoint_cache(cache: Path) -> list[str]:
    return sorted(os.listdir(cache / RUN / "checkpoints")) if (cache / RUN / "checkpoints").exists() else []


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
        assert local == (cache / RUN / "checkpoints" / "step-5").absolute()
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
    assert not (Path(fs_bucket.run_uri(RUN)) / "checkpoints").exists() or not os.listdir(
        Path(fs_bucket.run_uri(RUN)) / "checkpoints"
    )


@pytest.mark.parametrize(
    "name, data, error, message",
    [
        ("optimizer.pt", weights_of(10_005, 4096)[:1000], AdapterRejected,
         r"^optimizer.pt: size 1000 != manifest 4096 \(truncated or still uploading\?\)$"),
        ("scheduler.pt", bytes([weights_of(20_005, 100)[0] ^ 1]) + weights_of(20_005, 100)[1:], AdapterRejected,
         r"^scheduler.pt: sha256 \w+… != manifest \w+… \(corrupted or overwritten\?\)$"),
        ("rng_state.pth", None, AdapterRejected, r"^rng_state.pth: listed in the manifest but missing$"),
        ("manifest.json", None, AdapterNotFound, r"^step-5: no manifest.json (in|at) "),
    ],
    ids=["truncated", "flipped-byte", "file-missing", "manifest-missing"],
)  # fmt: skip
def test_tampered_checkpoint_is_refused_naming_the_file(bucket, tmp_path, name, data, error, message):
    uri = publish_checkpoint(bucket, 5, make_checkpoint(tmp_path / "src", 5))
    put(bucket, uri, name, data)
    with pytest.raises(error, match=message):
        bucket.fetch_checkpoint(uri, cache_dir=tmp_path / "cache")
    assert checkpoint_cache(tmp_path / "cache") == []  # nothing, not even a temporary, left in the cache
    if name == "manifest.json":
        assert bucket.list_checkpoints(RUN) == []  # without a manifest the checkpoint does not exist


def test_checkpoint_paths_outside_the_bucket_are_refused(fs_bucket, tmp_path):
    uri = Path(publish_checkpoint(fs_bucket, 1, make_checkpoint(tmp_path / "src", 1)))
    outside = Path(
        publish_checkpoint(Bucket(str(tmp_path / "elsewhere")), 2, make_checkpoint(tmp_path / "s2", 2))
    )

    def refused(path, message):
        with pytest.raises(AdapterRejected, match=message):
            fs_bucket.fetch_checkpoint(str(path), cache_dir=tmp_path / "cache")

    refused(f"{uri.parent}/../checkpoints/step-1", r"'\.\.' in a checkpoint path is refused")
    refused(outside, r"resolves to .*elsewhere.*, outside the bucket root")
    (uri.parent / "step-2").symlink_to(outside, target_is_directory=True)
    refused(uri.parent / "step-2", r"resolves to .*elsewhere.*, outside the bucket root")
    (uri.parent / "step-3").symlink_to(uri, target_is_directory=True)  # a renamed step inside the bucket
    refused(uri.parent / "step-3", r"^step-3: manifest describes 'step-1' \(copied or renamed checkpoint")
    assert fs_bucket.list_checkpoints(RUN) == [
        1,
        2,
        3,
    ]  # the links are listed (as for adapters), not fetchable
    assert fs_bucket.fetch_checkpoint(str(uri), cache_dir=tmp_path / "cache") == uri.resolve()


def test_checkpoint_retention_keeps_the_newest(bucket, tmp_path):
    for step in (10, 20, 30, 40, 50):
        publish_checkpoint(bucket, step, make_checkpoint(tmp_path / f"checkpoint-{step}", step))
    publish(bucket, 1, make_adapter(tmp_path / "adapter"))  # adapters are not touched
    with pytest.raises(ValueError, match="keep_last=0 must be an int >= 1"):
        bucket.apply_checkpoint_retention(RUN, keep_last=0)
    assert bucket.apply_checkpoint_retention(RUN, keep_last=2) == [10, 20, 30]
    assert bucket.list_checkpoints(RUN) == [40, 50]
    assert bucket.list_versions(RUN, "policy") == [1]
    for step in (10, 20, 30):  # gone entirely, not only their manifests
        path = bucket.checkpoint_uri(RUN, step)
        if bucket.is_remote:
            assert bucket.s3.find(path.removeprefix("s3://")) == []
        else:
            assert not Path(path).exists()
    assert bucket.apply_checkpoint_retention(RUN, keep_last=2) == []
    assert bucket.apply_checkpoint_retention(RUN, keep_last=1) == [40]
    local = bucket.fetch_checkpoint(bucket.checkpoint_uri(RUN, 50), cache_dir=tmp_path / "cache")
    assert (local / "trainer_state.json").read_text() == '{"global_step": 50}'


def test_reader_never_sees_a_partial_checkpoint(bucket, tmp_path):
    """A reader polling while 30 checkpoints are published only ever gets complete, matching ones."""
    n = 30
    writer_done = threading.Event()
    seen: list[int] = []
    not_found = 0
    errors: list[BaseException] = []

    expected_files = {*os.listdir(make_checkpoint(tmp_path / "expected" / "0", 0)), "manifest.json"}

    def read(reading: Bucket, step: int) -> None:
        local = reading.fetch_checkpoint(reading.checkpoint_uri(RUN, step), cache_dir=tmp_path / "cache")
        expected = make_checkpoint(tmp_path / "expected" / str(step), step)
        for name in os.listdir(expected):
            assert (local / name).read_bytes() == (expected / name).read_bytes(), (step, name)
        seen.append(step)

    def reader():
        nonlocal not_found
        reading = Bucket(bucket.uri, bucket.s3_endpoint_url, **FAST_RETRY)  # its own client, like a trainer
        try:
            while True:
                last_round = writer_done.is_set()
                latest = seen[-1] if seen else 0
                listed = [s for s in reading.list_checkpoints(RUN) if s > latest]
                if listed:  # listed means complete: every file is there at once, and it must verify
                    assert files_in(reading, reading.checkpoint_uri(RUN, listed[-1])) >= expected_files
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
        for step in range(1, n + 1):
            publish_checkpoint(bucket, step, make_checkpoint(tmp_path / f"checkpoint-{step}", step))
    finally:
        writer_done.set()
        thread.join(60)
    print(
        f"{n} checkpoints in {time.monotonic() - started:.1f}s; reader verified {len(seen)}, not found {not_found}"
    )
    assert not errors, errors[0]
    assert bucket.list_checkpoints(RUN) == list(range(1, n + 1))
    assert seen[-1] == n and len(seen) >= 5, seen  # the reader really ran alongside the writer
