"""The command line a new user meets first: each test runs the real entry point (the `rl-cluster` console
script, `jobs/*.py`, `python -m ...`) as a subprocess and checks the line it prints and its exit status.
Nothing here starts Ray or vLLM: every command fails (or answers) before that."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from rl_cluster.core.summary import step_record, summarize, summary_table

REPO = Path(__file__).resolve().parents[2]
# Registered by `pip install -e .` (make setup) beside the interpreter running the tests.
RL_CLUSTER = Path(sys.executable).parent / "rl-cluster"
CPU_DEMO = REPO / "jobs/configs/cpu_demo.toml"
CPU_MATH = REPO / "jobs/configs/cpu_math.toml"
HEAVY = ("ray", "torch", "vllm", "transformers", "datasets")


def run(*argv, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`rl-cluster ARGV`; a script (`jobs/x.py ...`) or `-m module ...` runs under this interpreter."""
    assert RL_CLUSTER.exists(), f"{RL_CLUSTER} is missing: `pip install -e .` registers the console script"
    script = argv[0].endswith(".py") or argv[0] == "-m"
    cmd = [sys.executable, *argv] if script else [str(RL_CLUSTER), *argv]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_help_lists_every_command_and_imports_nothing_heavy():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(RL_CLUSTER), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    listed = done.stdout.split("positional arguments:")[1]
    for command in ("train", "serve", "scale", "data", "experience", "summary", "runs"):
        assert f"\n    {command}" in listed, command
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert not imported & set(HEAVY), imported & set(HEAVY)


def test_a_typo_is_one_line_with_did_you_mean_and_exit_2():
    done = run("train", "--config", str(CPU_DEMO), "trainer.max_stepz=3")
    assert (done.returncode, done.stderr) == (
        2,
        f"{CPU_DEMO}: trainer.max_stepz: unknown field (did you mean max_steps?)\n",
    )
    # The jobs/ script is the same command (it must work under `ray job submit`, without the console script).
    done = run("jobs/train_grpo.py", "--config", "jobs/configs/cpu_demo.toml", "trainer.max_steps=abc")
    assert (done.returncode, done.stderr) == (
        2,
        "jobs/configs/cpu_demo.toml: trainer.max_steps: Input should be a valid integer (got 'abc')\n",
    )


def test_a_typo_shows_its_traceback_only_with_debug():
    done = run("--debug", "serve", "--config", str(CPU_DEMO), "generator.replicaz=1")
    assert done.returncode != 0 and "Traceback" in done.stderr and "did you mean replicas?" in done.stderr


def make_bucket(root: Path) -> dict:
    """Two runs as a run leaves them: one finished (summary.json from the real summarize()), one with only
    the config it wrote at its start; and a prepared dataset, which is no run."""
    history = [step_record(i + 1, {"reward": r}, i, 0.1) for i, r in enumerate([0.1] * 5 + [0.7] * 5)]
    evals = [
        {"step": s, "pass@1": p, "mean@k": p / 2, "k": 4, "problems": 10, "failed": 0}
        for s, p in ((0, 0.5), (10, 0.8))
    ]
    syncs = [{"version": 1, "adapter": "done-1-v1", "handoff_s": 0.2, "served_vs_trained_gap": 1e-7}]
    summary = summarize({"history": history, "syncs": syncs, "evals": evals}, {}, 12.0)
    (root / "done-1").mkdir(parents=True)
    (root / "done-1" / "config.resolved.json").write_text("{}")
    (root / "done-1" / "summary.json").write_text(json.dumps(summary, indent=2))
    (root / "going-2").mkdir()
    (root / "going-2" / "config.resolved.json").write_text("{}")
    (root / "datasets" / "tiny-abc").mkdir(parents=True)
    return summary


def test_summary_prints_a_runs_table_again_and_its_json(tmp_path):
    summary = make_bucket(tmp_path / "b")
    done = run("summary", "done-1", "--bucket", str(tmp_path / "b"))
    assert (done.returncode, done.stdout) == (0, f"run done-1 finished\n{summary_table(summary)}\n")
    assert "eval, last (step 10)" in done.stdout
    done = run("summary", "done-1", "--bucket", str(tmp_path / "b"), "--json")
    assert done.returncode == 0 and json.loads(done.stdout) == summary

    done = run("summary", "going-2", "--bucket", str(tmp_path / "b"))
    assert done.returncode == 2 and "going-2 has no summary.json: the run is still running" in done.stderr
    done = run("summary", "gone", "--bucket", str(tmp_path / "b"))
    assert (done.returncode, done.stderr) == (
        2,
        f"no run named 'gone' in {tmp_path / 'b'} (runs there: done-1, going-2)\n",
    )


def test_runs_lists_each_run_with_status_steps_reward_and_pass_at_1(tmp_path):
    make_bucket(tmp_path / "b")
    done = run("runs", "--bucket", str(tmp_path / "b"))
    assert done.returncode == 0, done.stderr
    header, *rows = [line.split("  ") for line in done.stdout.splitlines()]
    rows = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert rows == [
        ["done-1", "finished", "10", "0.700", "0.800"],
        ["going-2", "running or lost", "-", "-", "-"],
    ]
    done = run("runs", "--bucket", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and done.stderr.startswith(f"no bucket at {tmp_path / 'nowhere'}")


def test_experience_of_a_wrong_run_name_says_so_not_experience_enabled(tmp_path):
    make_bucket(tmp_path / "b")
    done = run("-m", "rl_cluster.experience", "dnoe-1", "--bucket", str(tmp_path / "b"))
    assert (done.returncode, done.stderr) == (
        2,
        f"no run named 'dnoe-1' in {tmp_path / 'b'} (runs there: done-1, going-2)\n",
    )
    # A run that is there but stored nothing: then the message is about the experience store.
    done = run("experience", "going-2", "--bucket", str(tmp_path / "b"))
    assert done.returncode == 2 and "no experience shards" in done.stderr and "Traceback" not in done.stderr


def test_prepare_before_tiny_math_is_one_line_naming_the_command(tmp_path):
    done = run("data", "prepare", "--config", str(CPU_MATH), f"bucket.uri={tmp_path / 'b'}", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        2,
        f"{CPU_MATH}: task.data_files: data/tiny_math/train.parquet, data/tiny_math/test.parquet not found "
        f"(in {tmp_path}); write the tiny MATH task first: python -m rl_cluster.data tiny-math --out "
        "data/tiny_math\n",
    )
    done = run("-m", "rl_cluster.data", "--debug", "prepare", "--config", str(CPU_MATH), cwd=tmp_path)
    assert (
        done.returncode == 1
        and "Traceback" in done.stderr
        and "tiny-math --out data/tiny_math" in done.stderr
    )


def test_train_whose_data_cannot_be_prepared_stops_before_ray_with_exit_2(tmp_path):
    """A run prepares data that is not prepared yet (test_data.py); data files that are not there are
    refused in one line, before any model or Ray is loaded."""
    done = run("train", "--config", str(CPU_MATH), f"bucket.uri={tmp_path / 'b'}", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith(f"no prepared data for this config at {tmp_path / 'b'}/datasets/")
    assert done.stderr.startswith(
        "task.data_files: data/tiny_math/train.parquet, data/tiny_math/test.parquet"
    )
    assert "tiny-math --out data/tiny_math" in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Ray" not in done.stdout + done.stderr


def test_an_s3_bucket_without_credentials_is_one_line_at_once_not_retried(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    # No credentials anywhere botocore looks: files, and never the metadata service (no traffic leaves).
    env |= {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
            "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
    cmd = [str(RL_CLUSTER), "train", "--config", str(CPU_DEMO), "bucket.uri=s3://b/x",
           "bucket.s3_endpoint_url=http://127.0.0.1:9"]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("no S3 credentials for s3://b/x") and "AWS_ACCESS_KEY_ID" in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "retrying" not in done.stdout + done.stderr


def test_a_bucket_that_cannot_be_one_is_one_line_and_exit_2_before_ray(tmp_path):
    """A file on the bucket's path, a bucket that is a file, a scheme that is no bucket: each used to end in
    a traceback (NotADirectoryError after 39 lines, or a run in a directory named 'gs:')."""
    (tmp_path / "afile").touch()
    expected = {
        "afile/sub": f"bucket.uri={tmp_path}/afile/sub: {tmp_path}/afile is a file, not a directory\n",
        "afile": f"bucket.uri={tmp_path}/afile: {tmp_path}/afile is a file, not a directory\n",
    }
    for uri, line in expected.items():
        done = run("jobs/train_grpo.py", "--config", str(CPU_DEMO), f"bucket.uri={tmp_path / uri}")
        assert (done.returncode, done.stderr, done.stdout) == (2, line, "")
    done = run("train", "--config", str(CPU_DEMO), "bucket.uri=gs://b/x", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        2,
        "bucket 'gs://b/x': a bucket is a directory (or file://...) or s3://bucket/prefix\n",
    )
    assert not (tmp_path / "gs:").exists()
    done = run("summary", "r", "--bucket", str(tmp_path / "afile" / "sub"))
    assert (done.returncode, done.stderr) == (
        2,
        f"--bucket {tmp_path}/afile/sub: {tmp_path}/afile is a file, not a directory\n",
    )
    for command in (["runs"], ["experience", "r"]):
        done = run(*command, "--bucket", "gs://b")
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    done = run("data", "prepare", "--config", str(CPU_MATH), f"bucket.uri={tmp_path / 'afile/sub'}")
    assert (done.returncode, done.stderr) == (
        2,
        f"bucket.uri={tmp_path}/afile/sub: {tmp_path}/afile is a file, not a directory\n",
    )


def test_a_command_that_cannot_reach_ray_says_where_it_tried_within_seconds(tmp_path):
    """ray.init retried an address where nothing listens for minutes (`scale` was still at it after 150 s),
    with warnings naming the node's IP instead of the address given."""
    with socket.socket() as s:  # a loopback port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    done = run("scale", "--run", "r", "--replicas", "2", "--address", address)
    assert done.returncode == 2 and done.stderr.startswith(f"no Ray answers at {address} (--address): "), (
        done.stderr
    )
    env = {**os.environ, "RAY_ADDRESS": f"ray://{address}"}
    cmd = [str(RL_CLUSTER), "train", "--config", str(CPU_DEMO), f"bucket.uri={tmp_path / 'b'}"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith(f"no Ray answers at ray://{address} (RAY_ADDRESS)")
    assert len(done.stderr.splitlines()) == 1
    done = run("serve", "--config", str(CPU_DEMO), f"cluster.address={address}")
    assert done.returncode == 2 and done.stderr.startswith(f"no Ray answers at {address} (cluster.address)")
    assert time.monotonic() - start < 15


def test_ray_that_listens_passes_the_check():
    from rl_cluster.commands import check_ray_answers

    with socket.create_server(("127.0.0.1", 0)) as server:
        check_ray_answers(f"127.0.0.1:{server.getsockname()[1]}", "--address")
    check_ray_answers("http://127.0.0.1:1", "RAY_ADDRESS")  # not host:port: left to Ray


def test_an_unreachable_bucket_is_one_line_without_a_warning_per_retry(caplog):
    """The retries' warnings (four before the last try) were printed above the line that sums them up."""
    import pytest

    from rl_cluster.bucket.store import retrying
    from rl_cluster.commands import bucket_errors
    from rl_cluster.core.retry import RetryPolicy
    from rl_cluster.errors import BucketUnavailable, UsageError

    def unreachable():
        raise ConnectionError("refused")

    policy = RetryPolicy(attempts=3, first_delay_s=0.001, max_delay_s=0.001)
    with pytest.raises(UsageError) as refused, bucket_errors("bucket.uri=s3://b/x"):
        retrying("s3://b/x", policy, "list b/x", unreachable)
    assert str(refused.value).startswith("bucket s3://b/x unreachable: list b/x failed 3 times in ")
    assert not caplog.records
    with pytest.raises(BucketUnavailable):  # and the warnings are back after it
        retrying("s3://b/x", policy, "list b/x", unreachable)
    assert len(caplog.records) == 2
