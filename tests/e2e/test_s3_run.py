"""The s3:// bucket end to end: a few training steps against a real S3 API (moto on loopback); both
replicas load every version from their own verified local cache. The run is the lockstep baseline
(trainer.mode=sync): every sample is trained on the policy it was generated with, none is dropped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import S3_ENV, moto_s3

from rl_cluster.bucket import Bucket

REPO = Path(__file__).resolve().parents[2]
RUN = "e2e-s3"


def test_training_through_an_s3_bucket(tmp_path, monkeypatch):
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    cache = tmp_path / "cache"
    with moto_s3("rl-e2e") as endpoint:
        proc = subprocess.run(
            [
                sys.executable,
                "jobs/train_grpo.py",
                "--config",
                "jobs/configs/cpu_demo.toml",
                f"run_name={RUN}",
                "cluster.address=local",
                "bucket.uri=s3://rl-e2e/runs",
                f"bucket.s3_endpoint_url={endpoint}",
                f"bucket.cache_dir={cache}",
                "trainer.max_steps=4",
                "trainer.mode=sync",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        bucket = Bucket("s3://rl-e2e/runs", endpoint)
        summary = json.loads(bucket.read_text(RUN, "summary.json"))
        published = bucket.list_versions(RUN, RUN)
        metrics = [json.loads(line) for line in bucket.read_text(RUN, "metrics.jsonl").splitlines()]

    assert summary["steps"] == len(metrics) == 4
    # Lockstep: each step trains on samples of the version published just before it.
    assert [m["staleness"] for m in metrics] == [0.0] * 4
    assert [m["policy_version"] for m in metrics] == [2, 3, 4, 5]
    groups = summary["groups"]
    assert (groups["trained"], groups["dropped_stale"], groups["failed"]) == (16, 0, 0)  # 4 steps x 4 groups
    # After the last sync the next step's groups may start; nothing more.
    assert 16 <= groups["generated"] <= 20
    assert published and len(summary["versions_published"]) >= 5  # v1 at start + one per step
    assert summary["served_vs_trained_gap"] <= 1e-3
    for replica, loaded in summary["versions_loaded"].items():
        assert set(summary["versions_published"]) <= set(loaded), replica
        # Each replica loaded from its own verified local copy, which keeps the live window.
        cached = {p.name for p in (cache / replica / RUN / "adapters").iterdir()}
        assert f"{RUN}-v{published[-1]}" in cached, (replica, cached)
        assert (cache / replica / RUN / "adapters" / f"{RUN}-v{published[-1]}" / "manifest.json").exists()
