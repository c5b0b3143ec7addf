"""Manifest rules: fingerprints, names, validation, each rejection's own message, retention."""

import dataclasses
import json

import pytest

from rl_cluster.core.manifest import (
    CHECKPOINT,
    AdapterMeta,
    adapter_dir_name,
    base_model_fingerprint,
    build_checkpoint_manifest,
    build_manifest,
    check_checkpoint_compatible,
    check_files,
    check_manifest,
    checkpoint_dir_name,
    manifest_to_json,
    parse_adapter_dir_name,
    parse_checkpoint_dir_name,
    parse_manifest,
    sha256_of,
    split_adapter_dir_name,
    versions_to_delete,
)
from rl_cluster.errors import AdapterRejected

TINY = {"model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 256, "vocab_size": 64}  # fmt: skip
FP = base_model_fingerprint(TINY)
WEIGHTS = b"w" * 100
CONFIG = b'{"r": 1}'
FILES = {"adapter_model.safetensors": sha256_of([WEIGHTS]), "adapter_config.json": sha256_of([CONFIG])}


def manifest(**overrides):
    """An adapter manifest; `overrides` name its fields, AdapterMeta's among them."""
    meta_fields = {f.name for f in dataclasses.fields(AdapterMeta)}
    meta = AdapterMeta(base_model="tiny", base_fingerprint=FP, rank=1, alpha=2.0, target_modules="all-linear",
                       trainer_step=12)  # fmt: skip
    meta = dataclasses.replace(meta, **{k: v for k, v in overrides.items() if k in meta_fields})
    rest = dict(adapter_name="policy", version=3, created_at="2026-01-01T00:00:00Z", files=FILES)
    return build_manifest(
        meta=meta, **{**rest, **{k: v for k, v in overrides.items() if k not in meta_fields}}
    )


def check(m, observed=None, fingerprint=FP, max_rank=8, expected_name=None):
    check_manifest(m, FILES if observed is None else observed, base_fingerprint=fingerprint,
                   max_lora_rank=max_rank, expected_name=expected_name)  # fmt: skip


def test_fingerprint_depends_on_architecture_only():
    assert base_model_fingerprint({**TINY, "torch_dtype": "bfloat16", "_name_or_path": "x"}) == FP
    assert base_model_fingerprint({**TINY, "hidden_size": 256}) != FP
    assert base_model_fingerprint({**TINY, "model_type": "llama"}) != FP


def test_fingerprint_fills_defaults_that_config_json_may_omit():
    without_defaults = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    assert base_model_fingerprint(without_defaults) == base_model_fingerprint({**without_defaults,
        "num_key_value_heads": 2, "head_dim": 64})  # fmt: skip
    assert base_model_fingerprint({**TINY, "head_dim": None}) == FP


def test_fingerprint_covers_nested_text_config():
    wrapped = {"model_type": "llava", "text_config": TINY}
    assert base_model_fingerprint(wrapped) != base_model_fingerprint({**wrapped, "text_config": {**TINY,
        "vocab_size": 65}})  # fmt: skip
    with pytest.raises(ValueError, match="architecture keys"):
        base_model_fingerprint({"foo": 1})


def test_dir_names_round_trip():
    assert adapter_dir_name("policy", 3) == "policy-v3"
    assert parse_adapter_dir_name("policy", "policy-v3") == 3
    assert parse_adapter_dir_name("run-v2", "run-v2-v10") == 10
    assert split_adapter_dir_name("run-v2-v10") == ("run-v2", 10)
    for other in [
        "policy-v",
        "policy-v03",
        "policy-vx",
        ".policy-v3.tmp-ab",
        "other-v3",
        "policy-v3.tmp",
        "policy-v٣",
    ]:
        assert parse_adapter_dir_name("policy", other) is None, other
    assert split_adapter_dir_name("policy") is None
    assert split_adapter_dir_name("-v3") is None


def test_manifest_round_trips_through_json():
    m = manifest(target_modules=["q_proj", "v_proj"])
    assert parse_manifest(manifest_to_json(m)) == m
    assert m["name"] == "policy-v3"
    assert m["files"]["adapter_model.safetensors"] == {
        "size": 100,
        "sha256": FILES["adapter_model.safetensors"][1],
    }
    check(m, expected_name="policy-v3")  # a good version passes every check


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("rank"), r"missing field\(s\) rank"),
        (lambda m: (m.pop("files"), m.pop("base_model")), r"missing field\(s\) base_model, files"),
        (lambda m: m.update(rank=True), r"field 'rank' should be int, got True"),
        (lambda m: m.update(trainer_step="12"), r"field 'trainer_step' should be int"),
        (lambda m: m.update(format=2), r"format 2 is not the supported 1"),
        (lambda m: m.update(rank=0), r"rank >= 1"),
        (lambda m: m.update(name="policy-v4"), r"name 'policy-v4' does not match"),
        (
            lambda m: m["files"].update({"../escape": m["files"]["adapter_config.json"]}),
            r"'../escape' is not a plain",
        ),
        (lambda m: m["files"].update({"manifest.json": m["files"]["adapter_config.json"]}), r"not a plain"),
        (lambda m: m["files"]["adapter_config.json"].update(size=-1), r"adapter_config.json: size -1 is not"),
        (lambda m: m["files"]["adapter_config.json"].update(sha256="ABC"), r"sha256 'ABC' is not 64"),
        (lambda m: m["files"].pop("adapter_model.safetensors"), r"does not list adapter_model.safetensors"),
    ],
)
def test_invalid_manifest_is_rejected_with_its_reason(edit, message):
    m = json.loads(manifest_to_json(manifest()))
    edit(m)
    with pytest.raises(AdapterRejected, match=message):
        parse_manifest(json.dumps(m), where="policy-v3/manifest.json")


def test_unparseable_manifest():
    with pytest.raises(AdapterRejected, match=r"policy-v3/manifest.json: not valid JSON"):
        parse_manifest('{"version": 3', where="policy-v3/manifest.json")
    with pytest.raises(AdapterRejected, match=r"expected a JSON object, got list"):
        parse_manifest("[]")


def test_writer_cannot_build_a_manifest_readers_would_refuse():
    with pytest.raises(AdapterRejected, match="does not list adapter_config.json"):
        manifest(files={"adapter_model.safetensors": FILES["adapter_model.safetensors"]})


def test_each_check_failure_has_its_own_message():
    m = manifest(rank=16)
    size, sha = FILES["adapter_model.safetensors"]
    cases = {
        "missing": ({"adapter_config.json": FILES["adapter_config.json"]}, {}),
        "truncated": ({**FILES, "adapter_model.safetensors": (size - 1, sha)}, {}),
        "flipped": ({**FILES, "adapter_model.safetensors": sha256_of([b"x" + WEIGHTS[1:]])}, {}),
        "base": (FILES, {"fingerprint": base_model_fingerprint({**TINY, "vocab_size": 99})}),
        "rank": (FILES, {"max_rank": 8}),
        "renamed": (FILES, {"expected_name": "policy-v4"}),
    }
    messages = {}
    for case, (observed, kwargs) in cases.items():
        kwargs = {"max_rank": 64, **kwargs}
        with pytest.raises(AdapterRejected) as info:
            check(m, observed, **kwargs)
        messages[case] = str(info.value)
    assert messages["missing"] == "adapter_model.safetensors: listed in the manifest but missing"
    assert (
        messages["truncated"]
        == "adapter_model.safetensors: size 99 != manifest 100 (truncated or still uploading?)"
    )
    assert messages["flipped"].startswith("adapter_model.safetensors: sha256 ")
    assert "(corrupted or overwritten?)" in messages["flipped"]
    assert messages["base"].startswith("policy-v3: trained on base model 'tiny' (fingerprint ")
    assert messages["rank"] == "policy-v3: rank 16 exceeds this replica's max LoRA rank 8"
    assert (
        messages["renamed"]
        == "policy-v4: manifest describes 'policy-v3' (copied or renamed version directory?)"
    )
    assert len(set(messages.values())) == len(messages)


def test_files_not_in_the_manifest_are_ignored():
    check(manifest(), {**FILES, "README.md": (5, "0" * 64)})


def test_retention_keeps_live_window_every_kth_and_protected():
    published = list(range(1, 13))
    assert versions_to_delete(published, live_window=3, keep_every=0, protected=set()) == list(range(1, 10))
    assert versions_to_delete(published, live_window=3, keep_every=4, protected=set()) == [
        1,
        2,
        3,
        5,
        6,
        7,
        9,
    ]
    assert versions_to_delete(published, live_window=3, keep_every=4, protected={1, 9}) == [2, 3, 5, 6, 7]
    assert versions_to_delete(published, live_window=20, keep_every=0, protected=set()) == []


def test_retention_edge_cases():
    assert versions_to_delete([], live_window=2, keep_every=0, protected={5}) == []
    assert versions_to_delete([5, 1, 3, 3], live_window=1, keep_every=0) == [1, 3]  # unsorted, duplicates
    assert versions_to_delete([0, 1, 2], live_window=1, keep_every=2, protected={7}) == [1]
    with pytest.raises(ValueError, match="live_window=0"):
        versions_to_delete([1], live_window=0, keep_every=0)
    with pytest.raises(ValueError, match="keep_every=-1"):
        versions_to_delete([1], live_window=1, keep_every=-1)


# -------------------------------------------------------------------- checkpoints

STATE = b'{"global_step": 5}'
CHECKPOINT_FILES = {
    **FILES,
    "optimizer.pt": sha256_of([b"o" * 300]),
    "trainer_state.json": sha256_of([STATE]),
}


def checkpoint_manifest(**overrides):
    meta = dict(step=5, base_model="tiny", base_fingerprint=FP, created_at="2026-01-01T00:00:00Z",
                files=CHECKPOINT_FILES)  # fmt: skip
    return build_checkpoint_manifest(**{**meta, **overrides})


def test_checkpoint_dir_names_round_trip():
    assert checkpoint_dir_name(50) == "step-50"
    assert checkpoint_dir_name(0) == "step-0"
    assert parse_checkpoint_dir_name("step-50") == 50
    for other in ["step-", "step-050", "step-x", ".step-5.tmp-ab", "checkpoint-5", "step-5.tmp", "step--1"]:
        assert parse_checkpoint_dir_name(other) is None, other
    for bad in [-1, True, "5", 5.0]:
        with pytest.raises(ValueError, match="must be an int >= 0"):
            checkpoint_dir_name(bad)


def test_checkpoint_manifest_round_trips_through_json():
    m = checkpoint_manifest()
    assert parse_manifest(manifest_to_json(m), kind=CHECKPOINT) == m
    assert (m["kind"], m["name"], m["step"]) == ("checkpoint", "step-5", 5)
    assert sorted(m["files"]) == ["adapter_config.json", "adapter_model.safetensors", "optimizer.pt",
                                  "trainer_state.json"]  # fmt: skip
    check_checkpoint_compatible(m, expected_name="step-5", base_fingerprint=FP)
    check_checkpoint_compatible(m)  # no name, no base model: nothing to compare
    check_files(m, CHECKPOINT_FILES)


def test_kinds_are_not_interchangeable():
    assert manifest()["kind"] == "adapter"
    with pytest.raises(
        AdapterRejected, match=r"^step-5/manifest.json: kind 'checkpoint', expected 'adapter'$"
    ):
        parse_manifest(manifest_to_json(checkpoint_manifest()), where="step-5/manifest.json")
    with pytest.raises(
        AdapterRejected, match=r"^policy-v3/manifest.json: kind 'adapter', expected 'checkpoint'$"
    ):
        parse_manifest(manifest_to_json(manifest()), where="policy-v3/manifest.json", kind=CHECKPOINT)
    with pytest.raises(ValueError, match="kind='model' is not one of adapter, checkpoint"):
        parse_manifest(manifest_to_json(manifest()), kind="model")


def test_adapter_manifest_written_before_kind_existed_is_still_valid():
    old = json.loads(manifest_to_json(manifest()))
    del old["kind"]
    assert parse_manifest(json.dumps(old)) == old
    with pytest.raises(AdapterRejected, match="kind 'adapter', expected 'checkpoint'"):
        parse_manifest(json.dumps(old), kind=CHECKPOINT)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("step"), r"missing field\(s\) step"),
        (lambda m: m.update(step="5"), r"field 'step' should be int, got '5'"),
        (lambda m: m.update(step=-1, name="step--1"), r"step must be >= 0"),
        (lambda m: m.update(name="step-6"), r"name 'step-6' does not match step 5"),
        (lambda m: m["files"].pop("trainer_state.json"), r"does not list trainer_state.json"),
        (
            lambda m: m["files"].update({"../optimizer.pt": m["files"]["optimizer.pt"]}),
            r"not a plain file name",
        ),
        (
            lambda m: m["files"]["optimizer.pt"].update(size=1.5),
            r"optimizer.pt: size 1.5 is not a byte count",
        ),
    ],
)
def test_invalid_checkpoint_manifest_is_rejected_with_its_reason(edit, message):
    m = json.loads(manifest_to_json(checkpoint_manifest()))
    edit(m)
    with pytest.raises(AdapterRejected, match=message):
        parse_manifest(json.dumps(m), where="step-5/manifest.json", kind=CHECKPOINT)


def test_checkpoint_check_failures_name_their_cause():
    m = checkpoint_manifest()
    with pytest.raises(
        AdapterRejected, match=r"^step-6: manifest describes 'step-5' \(copied or renamed checkpoint"
    ):
        check_checkpoint_compatible(m, expected_name="step-6")
    other = base_model_fingerprint({**TINY, "vocab_size": 99})
    with pytest.raises(AdapterRejected, match=r"^step-5: trained on base model 'tiny' \(fingerprint \w+…\), but "
                       r"this trainer uses a model with fingerprint \w+…$"):  # fmt: skip
        check_checkpoint_compatible(m, base_fingerprint=other)
    size, sha = CHECKPOINT_FILES["optimizer.pt"]
    with pytest.raises(AdapterRejected, match=r"^optimizer.pt: size 299 != manifest 300"):
        check_files(m, {**CHECKPOINT_FILES, "optimizer.pt": (size - 1, sha)})
    with pytest.raises(AdapterRejected, match="does not list trainer_state.json"):
        checkpoint_manifest(files=FILES)  # the writer cannot publish what a trainer could not resume from
