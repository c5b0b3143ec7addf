"""The watchdog ends a server's process group once the process that started it is gone."""

import subprocess
import sys
import time

from rl_cluster.generator.server import group_alive


def test_watchdog_ends_the_group_when_its_owner_dies(tmp_path):
    """The watchdog mechanism itself, on a stand-in process tree (the real vLLM case is in
    tests/integration/test_generator.py)."""
    tree = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    group = subprocess.Popen([sys.executable, "-c", tree], start_new_session=True)
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "rl_cluster.generator.watchdog", str(owner.pid), str(group.pid)],
        start_new_session=True,
    )
    time.sleep(1.5)
    assert group_alive(group.pid)
    owner.kill()
    owner.wait()
    watchdog.wait(timeout=20)
    group.wait(timeout=5)
    deadline = time.time() + 10
    while group_alive(group.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not group_alive(group.pid)
