"""Services on loopback that the tests and the benchmarks both start: a free port, an S3 API (moto).

Beside rl_cluster/, not in it (the package never starts these), and neither in tests/ nor in bench/ so
that neither reaches into the other for them; pytest (pyproject's pythonpath) and `python -m bench` both
run from the repository root, where this module is importable."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from rl_cluster.generator.server import terminate_group


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# moto accepts any credentials; s3fs and boto3 insist on some.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def moto_s3(bucket: str, log_path: Path | None = None) -> Iterator[str]:
    """A real S3-compatible server (moto) on a free loopback port with one bucket; yields its endpoint and
    always stops it (process group). Whoever then reads it through s3fs needs S3_ENV in the environment."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as files:
        if log_path is None:
            log = subprocess.DEVNULL
        else:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = files.enter_context(open(log_path, "ab"))
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-p", str(port), "-H", "127.0.0.1"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    try:
        credentials = {"aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"],
                       "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"]}  # fmt: skip
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **credentials)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.create_bucket(Bucket=bucket)  # no location constraint: moto refuses one
                break
            except Exception:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.1)
        yield endpoint
    finally:
        terminate_group(process.pid, grace_s=5)
        process.wait()
