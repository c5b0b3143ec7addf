"""WandbLog writes an offline W&B run that holds the steps, evals, config and summary (read back with
wandb's own reader of the `.wandb` transaction log), never a secret; "off" writes nothing; online without
an API key fails with what to set. Runs on a worker thread, as in the trainer actor."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import wandb
from wandb.util import get_core_path

from rl_cluster.config import RunConfig
from rl_cluster.trainer.wandb_log import WandbLog

SECRET = "proxy-token-never-in-clear"


@pytest.fixture(autouse=True)
def wandb_env(tmp_path, monkeypatch):
    """wandb's caches, settings and credentials in tmp_path; no prompt, no key; its service shut down."""
    home = tmp_path / "home"
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / "netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DIR", "WANDB_SERVICE"):
        monkeypatch.delenv(name, raising=False)
    # wandb's service connection replaces these for the whole process; restore them after the test
    monkeypatch.setattr(sys, "exit", sys.exit)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    yield
    wandb.teardown()


def on_thread(fn):
    """Run `fn` on a worker thread (a Ray actor's method runs on one) and return its result."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised on the test's thread
            out["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "wandb did not finish within 60 s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def read_records(sync_dir: Path) -> list[dict]:
    """The run's transaction log, record by record, as wandb-core's `leet inspect --json` reads it (the
    Python reader of `.wandb` files left the SDK when wandb-core took over writing them)."""
    (log,) = sync_dir.glob("run-*.wandb")
    command = [get_core_path(), "leet", "inspect", "--no-observability", "--json", "--run-file", str(log)]
    done = subprocess.run([*command, str(sync_dir.parent)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_offline_run_holds_steps_evals_config_and_summary(tmp_path):
    config = RunConfig(run_name="t", proxy={"auth_token": SECRET}, trainer={"learning_rate": 3e-5})

    def run():
        log = WandbLog(config, tmp_path / "work")
        log.log_eval({"kind": "eval", "step": 0, "pass@1": 0.25, "mean@k": 0.125, "k": 4, "adapter": "t-v0"})
        for step in (1, 2, 3):
            record = {"step": step, "reward": step / 10, "policy_version": step - 1, "loss": None,
                      "kl": float("nan"), "step_s": 1.5}  # fmt: skip
            log.log_step(step, record)
            if step == 2:
                log.log_eval({"kind": "eval", "step": 2, "pass@1": 0.5, "mean@k": 0.375, "k": 4})
        log.finish({"status": "finished", "steps": 3, "reward_last_fifth": 0.3, "groups": {"trained": 12},
                    "eval": {"last": {"pass@1": 0.5}}, "versions_published": ["t-v1"], "error": None})  # fmt: skip
        return log.sync_dir

    sync_dir = on_thread(run)
    assert sync_dir.parent == tmp_path / "work" / "wandb" and sync_dir.name.startswith("offline-run-")
    records = read_records(sync_dir)
    kinds = [r["type"] for r in records]

    (run_record,) = [r["run"] for r in records if r["type"] == "run"]
    assert run_record["run_id"] == "t" and run_record["display_name"] == "t"
    logged_config = run_record["config"]["update"]
    assert logged_config["trainer"]["learning_rate"] == 3e-5
    assert logged_config["proxy"]["auth_token"] == "**********"

    rows = {int(r["history"]["step"]["num"]): r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[0]["eval/pass@1"] == 0.25 and rows[0]["eval/mean@k"] == 0.125 and rows[0]["eval/k"] == 4
    assert [rows[s]["train/reward"] for s in (1, 2, 3)] == [0.1, 0.2, 0.3]
    assert [rows[s]["train/policy_version"] for s in (1, 2, 3)] == [0, 1, 2]
    assert rows[2]["eval/pass@1"] == 0.5 and rows[2]["train/step_s"] == 1.5
    assert not any(
        key.endswith(("/loss", "/kl", "/step", "/adapter", "/kind")) for row in rows.values() for key in row
    )

    summary: dict = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"]["update"])
    assert summary["status"] == "finished" and summary["steps"] == 3 and summary["reward_last_fifth"] == 0.3
    assert summary["groups/trained"] == 12 and summary["eval/last/pass@1"] == 0.5
    assert "versions_published" not in summary and "error" not in summary
    assert kinds[-1] == "exit" and records[-1]["exit"].get("exit_code", 0) == 0

    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]


def test_failed_run_is_marked_failed(tmp_path):
    def run():
        log = WandbLog(RunConfig(run_name="f"), tmp_path)
        log.log_step(1, {"reward": 0.0})
        log.finish({"status": "failed", "error": "boom"})
        return log.sync_dir

    records = read_records(on_thread(run))
    assert records[-1]["type"] == "exit" and records[-1]["exit"]["exit_code"] == 1


def test_off_writes_nothing(tmp_path):
    log = WandbLog(RunConfig(run_name="t", logging={"wandb": "off"}), tmp_path / "work")
    log.log_step(1, {"reward": 1.0})
    log.log_eval({"step": 1, "pass@1": 1.0})
    log.finish({"status": "finished"})
    assert log.sync_dir is None and not (tmp_path / "work").exists()


def test_online_without_api_key_says_what_to_set(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # were a key found after all: no network
    config = RunConfig(run_name="t", logging={"wandb": "online"})
    with pytest.raises(RuntimeError, match=r'logging.wandb = "off".*WANDB_API_KEY'):
        on_thread(lambda: WandbLog(config, tmp_path))
