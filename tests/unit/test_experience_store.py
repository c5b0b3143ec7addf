"""The experience store against a real directory bucket: ExperienceWriter with TRL's own RolloutSample,
committed shards, verification on read, `datasets` reading them back, the CLI, and replay on the tiny
model."""

import math
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from rl_cluster.bucket import Bucket
from rl_cluster.errors import AdapterNotFound, AdapterRejected
from rl_cluster.experience import ExperienceWriter, load_experience
from rl_cluster.experience.__main__ import main

RUN = "run1"
N = 4  # num_generations


@pytest.fixture
def bucket(tmp_path):
    return Bucket(str(tmp_path / "bucket"), attempts=1)


def rollout(group_id, k, *, version=1, prompt_len=5, completion_len=6, reward=None, seed=None):
    rng = np.random.default_rng(seed if seed is not None else group_id * 100 + k)
    ids = rng.integers(3, 99, prompt_len + completion_len)
    mask = np.r_[np.zeros(prompt_len), np.ones(completion_len)].astype(np.int64)
    logprobs = np.where(mask == 1, -rng.random(len(ids)), 0.0).astype(np.float32)
    reward = float(k % 2) if reward is None else reward
    return RolloutSample(
        prompt=[{"role": "user", "content": "1+1"}], completion=[{"role": "assistant", "content": "2"}],
        input_ids=ids, completion_mask=mask, old_log_probs=logprobs, advantage=reward - 0.5,
        model_version=version, group_id=group_id,
        metrics={"reward": reward, "reward_std": 0.5, "rewards/accuracy": reward},
        enqueued_at=None if k == 0 else 1000.0 + k,
    )  # fmt: skip


def writer(bucket, **kw):
    return ExperienceWriter(bucket, RUN, "run1", num_generations=N, **{"shard_groups": 2, **kw})


def add_groups(w, groups, *, version=1, trainer_version=None, trained=True):
    for g in groups:
        for k in range(N):
            w.add(rollout(g, k, version=version), trainer_version=trainer_version or version, trained=trained)


def shard_groups(bucket, w):
    """Group ids in each committed shard of the writer's segment, in seq order."""
    out = []
    for seq, segment in bucket.list_experience_shards(RUN):
        assert segment == w.segment
        path = bucket.fetch_experience_shard(
            bucket.experience_shard_uri(RUN, seq, segment), cache_dir="unused"
        )
        out.append(sorted(set(pq.read_table(path, columns=["group_id"])["group_id"].to_pylist())))
    return out


def test_shards_hold_complete_groups_and_the_rest_goes_out_at_close(bucket):
    w = writer(bucket)
    w.add(rollout(0, 0), trainer_version=1, trained=True)  # group 0 stays incomplete for a while
    add_groups(w, [1, 2])  # two complete groups: the first shard
    add_groups(w, [3])
    for k in range(1, N):
        w.add(rollout(0, k), trainer_version=1, trained=True)  # group 0 completes: the second shard
    add_groups(w, [4])  # one group left: written at close
    stats = w.close(timeout=30)
    assert shard_groups(bucket, w) == [[1, 2], [0, 3], [4]]
    assert stats == {"shards": 3, "groups": 5, "rows": 5 * N, "bytes": stats["bytes"], "failed_shards": 0,
                     "lost_rows": 0}  # fmt: skip
    assert stats["bytes"] > 0
    assert w.close() == stats  # closing twice is harmless
    with pytest.raises(RuntimeError):
        w.add(rollout(9, 0), trainer_version=1, trained=True)


def test_rows_read_back_exactly_through_datasets(bucket):
    w = writer(bucket)
    add_groups(w, [0], version=2, trainer_version=4, trained=False)
    add_groups(w, [1], version=3, trainer_version=4)
    w.close(timeout=30)
    ds = load_experience(bucket, RUN)
    assert len(ds) == 2 * N
    by_key = {(r["group_id"], i % N): r for i, r in enumerate(ds)}
    for g, version in [(0, 2), (1, 3)]:
        for k in range(N):
            s, r = rollout(g, k, version=version), by_key[(g, k)]
            assert r["prompt_ids"] + r["completion_ids"] == s.input_ids.tolist()
            assert r["prompt_ids"] == s.input_ids[:5].tolist()
            assert r["logprobs"] == s.old_log_probs[5:].tolist()  # float32 in, float32 out: exact
            assert r["completion_mask"] == [1] * 6
            assert r["rewards"] == {"accuracy": s.metrics["reward"]} and r["advantage"] == s.advantage
            assert (r["adapter"], r["staleness"], r["trained"]) == (f"run1-v{version}", 4 - version, g == 1)
            assert r["enqueued_at"] == s.enqueued_at and r["segment"] == w.segment and r["pulled_at"] > 0


def test_groups_are_counted_per_trainer_process(bucket, capsys):
    # A restarted trainer numbers its groups from 0 again: its own segment keeps them apart.
    for _ in range(2):
        w = writer(bucket)
        add_groups(w, [0, 1, 2], version=1)
        w.close(timeout=30)
    assert len({seg for _, seg in bucket.list_experience_shards(RUN)}) == 2
    assert main([RUN, "--bucket", bucket.uri]) == 0
    header, v1, total = capsys.readouterr().out.splitlines()
    assert v1.split()[:6] == ["1", "run1-v1", "6", str(6 * N), "6", "0"]
    assert v1.split()[6] == f"{sum(k % 2 for k in range(N)) / N:.3f}"
    assert total.split()[:3] == ["all", "6", str(6 * N)]


def test_a_shard_without_its_manifest_does_not_exist(bucket):
    w = writer(bucket)
    add_groups(w, [0, 1, 2, 3])
    w.close(timeout=30)
    (seq0, segment), second = bucket.list_experience_shards(RUN)
    shard = bucket.experience_shard_uri(RUN, seq0, segment)
    (Path(shard) / "manifest.json").unlink()  # as if the writer died before its last write
    assert bucket.list_experience_shards(RUN) == [second]
    with pytest.raises(AdapterNotFound):
        bucket.fetch_experience_shard(shard, cache_dir="unused")
    assert len(load_experience(bucket, RUN)) == 2 * N


def test_a_corrupted_shard_is_refused_naming_the_file(bucket):
    w = writer(bucket)
    add_groups(w, [0, 1])
    w.close(timeout=30)
    ((seq, segment),) = bucket.list_experience_shards(RUN)
    path = bucket.fetch_experience_shard(bucket.experience_shard_uri(RUN, seq, segment), cache_dir="unused")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(AdapterRejected, match=r"rows\.parquet: sha256 .* \(corrupted or overwritten\?\)"):
        load_experience(bucket, RUN)


def test_a_copied_shard_is_refused(bucket):
    w = writer(bucket)
    add_groups(w, [0, 1])
    w.close(timeout=30)
    ((seq, segment),) = bucket.list_experience_shards(RUN)
    copy = bucket.experience_shard_uri(RUN, seq + 1, segment)
    shutil.copytree(bucket.experience_shard_uri(RUN, seq, segment), copy)
    assert len(bucket.list_experience_shards(RUN)) == 2  # listed; reading it is where it is refused
    with pytest.raises(AdapterRejected, match=r"manifest describes 'shard-000000-\w+' \(copied or renamed"):
        load_experience(bucket, RUN)


def test_publishing_a_shard_twice_is_refused(bucket, tmp_path):
    w = writer(bucket)
    add_groups(w, [0, 1])
    w.close(timeout=30)
    ((seq, segment),) = bucket.list_experience_shards(RUN)
    with pytest.raises(FileExistsError, match="never reused"):
        bucket.publish_experience_shard(RUN, seq, segment, tmp_path / "any.parquet", rows=1, groups=1)


def test_writer_errors_never_reach_the_trainer(tmp_path, capsys):
    (tmp_path / "not-a-dir").write_text("a file where the bucket should be")
    w = writer(Bucket(str(tmp_path / "not-a-dir"), attempts=1))
    add_groups(w, [0, 1, 2, 3, 4])  # 3 shards, each of which fails
    bad = rollout(5, 0)
    bad.old_log_probs = bad.old_log_probs[:3]  # misaligned: cannot be made a row
    w.add(bad, trainer_version=1, trained=True)
    stats = w.close(timeout=30)
    assert (stats["shards"], stats["failed_shards"], stats["lost_rows"]) == (0, 3, 5 * N + 1)
    err = capsys.readouterr().err
    assert err.count("experience store:") == 2  # the first failure, with what to do; the summary at close
    assert "Training goes on" in err and "not-a-dir" in err and f"{5 * N + 1} rows were not stored" in err


def test_a_slow_bucket_drops_shards_instead_of_stalling_training(bucket, monkeypatch):
    release = threading.Event()
    publish = bucket.publish_experience_shard

    def slow_publish(*args, **kwargs):
        release.wait(30)
        return publish(*args, **kwargs)

    monkeypatch.setattr(bucket, "publish_experience_shard", slow_publish)
    w = writer(bucket, shard_groups=1, max_pending=1)
    started = time.monotonic()
    add_groups(w, range(6))  # 6 shards: one being written, one waiting, the rest dropped
    assert time.monotonic() - started < 5
    release.set()
    stats = w.close(timeout=30)
    assert stats["shards"] + stats["lost_rows"] // N == 6 and stats["lost_rows"] >= 3 * N
    assert len(bucket.list_experience_shards(RUN)) == stats["shards"]


# -------------------------------------------------------------------- replay on the tiny model


def _adapter(model_dir, out, *, perturb):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(r=1, lora_alpha=2, target_modules="all-linear"),
    )
    if perturb:  # LoRA's B starts at zero (the adapter is then the base model); move it
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    model.save_pretrained(out)
    return out


def _sampled(model_dir, n_groups):
    """Rollouts whose stored logprobs come from the base model's own forward pass, one sequence at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    samples = []
    for g in range(n_groups):
        for k in range(N):
            s = rollout(
                g, k, version=3, prompt_len=4 + k, completion_len=10 + 3 * k
            )  # ragged: padding matters
            ids = torch.tensor(s.input_ids)[None]
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            token_logp = logp.gather(-1, ids[0, 1:, None])[:, 0].numpy()
            s.old_log_probs = np.where(s.completion_mask[1:] == 1, token_logp, 0.0).astype(np.float32)
            s.old_log_probs = np.r_[np.float32(0.0), s.old_log_probs]
            samples.append(s)
    return samples


def _replay_total(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("replay of run1-v3: 2 groups, 8 samples")
    per_group = [line.split() for line in out[2:-1]]
    assert len(per_group) == 2
    total = out[-1].split()
    assert total[0] == "all"
    return {"gap": float(total[4]), "ratio": float(total[5]), "loss": float(total[6]), "groups": per_group}


def test_replay_under_the_sampling_weights_gives_no_gap_and_another_adapter_does(
    bucket, tiny_model_dir, tmp_path, capsys
):
    w = writer(bucket)
    for s in _sampled(tiny_model_dir, 3):
        w.add(s, trainer_version=3, trained=True)
    w.close(timeout=30)
    argv = [RUN, "--bucket", bucket.uri, "--replay", "3", "--model", str(tiny_model_dir), "--max-groups", "2"]
    argv += ["--batch-size", "3"]
    same = _replay_total(
        capsys, [*argv, "--adapter-dir", str(_adapter(tiny_model_dir, tmp_path / "a0", perturb=False))]
    )
    assert same["gap"] < 1e-4 and abs(same["ratio"] - 1) < 1e-4
    # `--model tiny` names the same model as a run's model.path does (no hub is asked).
    by_name = [*argv, "--adapter-dir", str(tmp_path / "a0")]
    by_name[by_name.index(str(tiny_model_dir))] = "tiny"
    assert _replay_total(capsys, by_name)["gap"] == same["gap"]
    other = _replay_total(
        capsys, [*argv, "--adapter-dir", str(_adapter(tiny_model_dir, tmp_path / "a1", perturb=True))]
    )
    assert other["gap"] > 1e-2 and abs(other["ratio"] - 1) > 1e-3
    assert not math.isclose(other["loss"], same["loss"], abs_tol=1e-3)
    assert all(float(g[4]) > 1e-3 for g in other["groups"])  # every group moved, not just one
