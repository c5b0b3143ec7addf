"""`make setup`'s stamp knows the stack it installed: `make -n` (prints the commands, runs none) on a
.venv in tmp_path, stamped as each stack leaves it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def setup_commands(venv: Path, stack: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "STACK"} | ({"STACK": stack} if stack else {})
    done = subprocess.run(["make", "-n", "-C", str(REPO), "setup", f"VENV={venv}"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(
    "stamp,stack,wiped,installed",
    [
        (None, None, False, "cpu"),  # a new .venv: the CPU stack by default
        (None, "gpu", False, "gpu"),
        (".installed-cpu", None, False, None),  # done: nothing to do
        (".installed-cpu", "gpu", True, "gpu"),  # switching stacks starts from a new .venv
        (".installed-gpu", None, False, None),  # a GPU .venv stays one: `make lint` there does not switch
        (".installed-gpu", "cpu", True, "cpu"),
        (".installed", "cpu", False, "cpu"),  # the single stamp of before was a CPU install: kept
        (".installed", "gpu", True, "gpu"),
    ],
)
def test_setup_installs_the_stack_asked_for_and_only_then(tmp_path, stamp, stack, wiped, installed):
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    if stamp:
        (venv / stamp).touch()
    commands = setup_commands(venv, stack)
    assert (f"rm -rf {venv}\n" in commands) == wiped, commands
    extra = {"cpu": ".[cpu,dev]", "gpu": ".[gpu,dev]", None: "pip install"}[installed]
    assert (extra in commands) == (installed is not None), commands
    if installed:
        assert f"touch {venv}/.installed-{installed}\n" in commands


def test_an_unknown_stack_is_refused():
    done = subprocess.run(["make", "-n", "-C", str(REPO), "setup"], env={**os.environ, "STACK": "tpu"},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and "STACK=tpu: cpu or gpu" in done.stderr
