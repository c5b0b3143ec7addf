"""The experience store's pure rules: rows, shard names, shard manifests, the per-version table, replay."""

import json
import math
from types import SimpleNamespace

import pytest

from rl_cluster.core import experience
from rl_cluster.core.experience import (
    COLUMNS,
    SHARD_FILE,
    build_shard_manifest,
    format_version_table,
    new_segment,
    parse_shard_dir_name,
    parse_shard_manifest,
    replay_stats,
    sample_row,
    shard_dir_name,
    total_row,
    version_table,
)
from rl_cluster.core.manifest import manifest_to_json
from rl_cluster.errors import AdapterRejected

SHA = "ab" * 32


def sample(group_id=3, version=5, prompt=(7, 8, 9), completion=(10, 11, 12, 13), reward=1.0, **kw):
    ids = [*prompt, *completion]
    mask = kw.pop("mask", [0] * len(prompt) + [1] * len(completion))
    logprobs = kw.pop("logprobs", [0.0] * len(prompt) + [-0.5 - i for i in range(len(completion))])
    return SimpleNamespace(
        input_ids=ids,
        completion_mask=mask,
        old_log_probs=logprobs,
        advantage=kw.pop("advantage", 0.75),
        model_version=version,
        group_id=group_id,
        metrics={"reward": reward, "reward_std": 0.4, "rewards/accuracy": reward, "rewards/format": 0.0},
        enqueued_at=kw.pop("enqueued_at", 100.0),
    )


def row(s=None, *, segment="00000001ab", trainer_version=7, trained=True, pulled_at=101.5):
    return sample_row(
        s or sample(), segment=segment, adapter_name="run", trainer_version=trainer_version, trained=trained,
        pulled_at=pulled_at,
    )  # fmt: skip


def test_row_splits_prompt_from_completion_and_keeps_completion_logprobs():
    r = row()
    assert list(r) == list(COLUMNS)
    assert r["prompt_ids"] == [7, 8, 9] and r["completion_ids"] == [10, 11, 12, 13]
    assert r["completion_mask"] == [1, 1, 1, 1]
    assert r["logprobs"] == [-0.5, -1.5, -2.5, -3.5]
    assert (r["model_version"], r["adapter"], r["trainer_version"], r["staleness"]) == (5, "run-v5", 7, 2)
    assert r["rewards"] == {"accuracy": 1.0, "format": 0.0}  # reward_std is a group figure, not a reward
    assert (r["reward"], r["advantage"], r["enqueued_at"], r["pulled_at"], r["trained"]) == (
        1.0,
        0.75,
        100.0,
        101.5,
        True,
    )


def test_multi_turn_context_inside_the_completion_keeps_its_zero_mask():
    # turn 1 (trained), a tool's answer (context), turn 2 (trained)
    s = sample(prompt=(1, 2), completion=(3, 4, 50, 51, 5), mask=[0, 0, 1, 1, 0, 0, 1],
               logprobs=[0.0, 0.0, -1.0, -2.0, 0.0, 0.0, -3.0])  # fmt: skip
    r = row(s)
    assert r["prompt_ids"] + r["completion_ids"] == [1, 2, 3, 4, 50, 51, 5]
    assert r["completion_mask"] == [1, 1, 0, 0, 1] and r["logprobs"] == [-1.0, -2.0, 0.0, 0.0, -3.0]


def test_misaligned_sample_is_refused():
    with pytest.raises(ValueError, match="aligned"):
        row(sample(logprobs=[0.0, -1.0]))


def test_every_column_is_documented_in_the_module_docstring():
    for name in COLUMNS:
        assert f"\n    {name} " in experience.__doc__, name


def test_shard_names_round_trip_and_refuse_lookalikes():
    assert shard_dir_name(7, "6650a1b2c3d4") == "shard-000007-6650a1b2c3d4"
    assert parse_shard_dir_name("shard-000007-6650a1b2c3d4") == (7, "6650a1b2c3d4")
    assert parse_shard_dir_name(shard_dir_name(1234567, "x1")) == (1234567, "x1")
    for name in [
        "shard-7-abc",
        "shard-0000007-abc",
        "shard-000007-",
        "shard-000007-ABC",
        ".shard-000007-a.tmp-1",
    ]:
        assert parse_shard_dir_name(name) is None, name
    with pytest.raises(ValueError):
        shard_dir_name(-1, "abc")
    with pytest.raises(ValueError):
        shard_dir_name(0, "a/b")


def test_segments_are_plain_and_sort_by_the_time_they_were_made():
    early, late = new_segment(now=1_700_000_000), new_segment(now=1_700_000_001)
    assert early < late and len(early) == 12
    assert shard_dir_name(0, early)  # a valid segment
    assert (
        len({new_segment(now=0) for _ in range(50)}) > 1
    )  # random part: two trainers started together differ


def manifest(**over):
    fields = dict(seq=3, segment="abc1", rows=40, groups=5, created_at="t", files={SHARD_FILE: (10, SHA)})
    return build_shard_manifest(**{**fields, **over})


def test_shard_manifest_round_trips_and_is_checked():
    m = manifest()
    assert m["name"] == "shard-000003-abc1" and m["kind"] == "experience"
    assert parse_shard_manifest(manifest_to_json(m), "x") == m
    wrong_name = {**m, "name": "shard-000004-abc1"}
    with pytest.raises(AdapterRejected, match="does not match"):
        parse_shard_manifest(json.dumps(wrong_name), "x")
    with pytest.raises(AdapterRejected, match=f"does not list {SHARD_FILE}"):
        manifest(files={"other.parquet": (10, SHA)})
    with pytest.raises(AdapterRejected, match="kind 'adapter'"):
        parse_shard_manifest(json.dumps({k: v for k, v in m.items() if k != "kind"}), "x")
    with pytest.raises(AdapterRejected, match="not valid JSON"):
        parse_shard_manifest("{", "x")


def rows_of(
    version, group_id, n, *, segment="s1", reward=1.0, trained=True, completion=4, trainer_version=None
):
    s = sample(group_id=group_id, version=version, completion=tuple(range(completion)), reward=reward)
    tv = version + 1 if trainer_version is None else trainer_version
    return [row(s, segment=segment, trained=trained, trainer_version=tv) for _ in range(n)]


def test_version_table_counts_groups_per_segment_and_by_fate():
    rows = (
        rows_of(1, 0, 4, reward=1.0)
        + rows_of(1, 0, 4, segment="s2", reward=0.0, completion=8)  # same group_id, another trainer process
        + rows_of(2, 1, 4, reward=math.nan, trained=False, trainer_version=5)  # unscored, dropped as stale
        + rows_of(2, 2, 2, reward=0.5)
        + rows_of(2, 2, 2, reward=0.5, trained=False)  # split across a sync: trained and dropped
    )
    v1, v2 = version_table(rows)
    assert v1 == {"version": 1, "adapter": "run-v1", "groups": 2, "samples": 8, "trained_groups": 2,
                  "dropped_groups": 0, "reward_mean": 0.5, "completion_len_mean": 6.0, "staleness_mean": 1.0}  # fmt: skip
    assert (v2["groups"], v2["samples"], v2["trained_groups"], v2["dropped_groups"]) == (2, 8, 1, 2)
    assert v2["reward_mean"] == 0.5  # NaN rewards are skipped
    assert v2["staleness_mean"] == (4 * 3 + 4 * 1) / 8
    total = total_row(rows)
    assert (total["groups"], total["samples"]) == (4, 16)
    text = format_version_table([v1, v2], total)
    header, line1, line2, last = text.splitlines()
    assert header.split() == ["version", "adapter", "groups", "samples", "trained", "dropped", "reward",
                              "compl_len", "staleness"]  # fmt: skip
    assert line1.split() == ["1", "run-v1", "2", "8", "2", "0", "0.500", "6.0", "1.00"]
    assert line2.split()[:6] == ["2", "run-v2", "2", "8", "1", "2"]
    assert last.split()[:3] == ["all", "4", "16"]
    assert len({len(line) for line in text.splitlines()}) == 1  # aligned


def test_replay_stats_measure_the_gap_over_trained_tokens_only():
    s = sample(
        prompt=(1,), completion=(2, 3, 4), mask=[0, 1, 0, 1], logprobs=[0.0, -1.0, 0.0, -2.0], advantage=2.0
    )
    r = row(s)
    same, total = replay_stats([r], [[-1.0, 99.0, -2.0]])  # the masked token's value is ignored
    assert same[0]["tokens"] == 2 and same[0]["logprob_gap_mean"] == 0.0 and same[0]["ratio_mean"] == 1.0
    assert same[0]["loss"] == -2.0  # -mean(ratio * advantage)
    shifted, total = replay_stats([r, r], [[-0.9, 0.0, -2.1]] * 2)
    assert shifted[0]["samples"] == 2 and total["groups"] == 1 and total["tokens"] == 4
    assert shifted[0]["logprob_gap_mean"] == pytest.approx(0.1)
    assert total["ratio_mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.1)) / 2)
    assert total["loss"] == pytest.approx(-2.0 * (math.exp(0.1) + math.exp(-0.1)) / 2)


def test_replay_skips_the_first_token_of_a_sequence_without_prompt():
    s = sample(prompt=(), completion=(2, 3), mask=[1, 1], logprobs=[-5.0, -1.0])
    (group,), _ = replay_stats([row(s)], [[0.0, -1.0]])
    assert group["tokens"] == 1 and group["logprob_gap_mean"] == 0.0
