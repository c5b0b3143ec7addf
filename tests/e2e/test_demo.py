"""The whole system, for real: a shortened `make demo` as a subprocess (local Ray cluster, two vLLM CPU
servers, the proxy, TRL training, a bucket directory), then what it left behind."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

from conftest import wait_until_no_vllm_with

REPO = Path(__file__).resolve().parents[2]
RUN = "e2e-demo"


def test_shortened_demo(tmp_path):
    bucket = tmp_path / "bucket"
    marker = f"RL_CLUSTER_E2E={uuid.uuid4().hex}"
    proc = subprocess.run(
        [
            sys.executable,
            "jobs/train_grpo.py",
            "--config",
            "jobs/configs/cpu_demo.toml",
            f"run_name={RUN}",
            "cluster.address=local",
            f"bucket.uri={bucket}",
            "trainer.max_steps=60",
        ],
        cwd=REPO,
        env={**os.environ, **dict([marker.split("=")])},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]

    # What a run shows: progress lines and the summary table.
    assert "step   60/60" in proc.stdout
    assert "reward, last fifth" in proc.stdout

    run_dir = bucket / RUN
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 60
    for name in ("config.resolved.json", "metrics.jsonl", "curves.png"):
        assert (run_dir / name).stat().st_size > 0, name

    # Reward improved, robustly: the last fifth beats the first, and so does the whole second half.
    rewards = [json.loads(line)["reward"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["reward_last_fifth"] - summary["reward_first_fifth"] >= 0.1, summary
    assert statistics.mean(rewards[30:]) > statistics.mean(rewards[:30]) + 0.05, rewards

    # Every published version was loaded on every replica, and both replicas served requests.
    published = summary["versions_published"]
    assert len(published) >= 60 // 4
    assert len(summary["versions_loaded"]) == 2
    for replica, loaded in summary["versions_loaded"].items():
        assert set(published) <= set(loaded), (replica, sorted(set(published) - set(loaded)))
    assert all(n > 0 for n in summary["requests"].values()), summary["requests"]

    # The newest adapters are in the bucket, each with its manifest.
    for name in published[-3:]:
        manifest = json.loads((run_dir / "adapters" / name / "manifest.json").read_text())
        assert manifest["adapter_name"] == name or manifest["version"] == int(name.rsplit("-v", 1)[1])
        assert (run_dir / "adapters" / name / "adapter_model.safetensors").exists()

    # The trainer's packed attention (our CPU replacement of TRL's kernel) scores the first step's tokens
    # as the sampler did: the adapter is still zero there, so their KL is numerically zero.
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["kl"] is not None and abs(first["kl"]) < 1e-4, first

    # Checkpoints every 50 steps and at the end, each published with its manifest (files, then manifest).
    assert [Path(uri).name for uri in summary["checkpoints"]] == ["step-50", "step-60"]
    for step in (50, 60):
        manifest = json.loads((run_dir / "checkpoints" / f"step-{step}" / "manifest.json").read_text())
        assert {"adapter_model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(manifest["files"])

    # Served = trained.
    assert summary["served_vs_trained_gap"] is not None
    assert summary["served_vs_trained_gap"] <= 1e-3

    # No vLLM process outlives the run (watchdogs may need a few seconds).
    assert not wait_until_no_vllm_with(marker)
