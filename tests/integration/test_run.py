"""The run's entrypoint refuses what cannot work before it starts anything (no Ray, no vLLM)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import publish_lora

from rl_cluster.bucket import Bucket

REPO = Path(__file__).resolve().parents[2]


def train(*overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "jobs/train_grpo.py", "--config", "jobs/configs/cpu_demo.toml", *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_reused_run_name_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    bucket = Bucket(str(tmp_path / "bucket"))
    publish_lora(bucket, "taken", 1, tiny_model_dir, tmp_path)
    done = train("run_name=taken", f"bucket.uri={tmp_path / 'bucket'}", "cluster.address=local")
    assert done.returncode == 2  # refused before anything started
    assert (
        "already holds adapters of a run named 'taken'" in done.stderr
        and "Pick another run_name" in done.stderr
    )
    assert "Started a local Ray instance" not in done.stdout + done.stderr
    # The earlier run's files are untouched: nothing was written over them.
    assert not (tmp_path / "bucket" / "taken" / "config.resolved.json").exists()
    assert bucket.list_versions("taken", "taken") == [1]


def test_a_wrong_config_names_the_field(tmp_path):
    done = train("run_name=x", f"bucket.uri={tmp_path}", "generator.max_loras=2")
    assert done.returncode == 2  # refused before anything started
    assert "generator.max_loras=2 cannot hold the live window" in done.stderr
